/*
 * A multi-extent bump arena.
 *
 * The caller hands over up to GB_MAX_EXTENTS address ranges it owns (the idle free
 * runs of a CUDA-graph pool); malloc carves aligned pieces from them and never reuses
 * anything. Reuse is the job of the caching allocator above (a torch MemPool), which
 * only asks for whole segments. free only counts bytes, so the caller can see that the
 * caching layer released segments (e.g. empty_cache) and rebuild.
 *
 * Every instance lives in its own slot with its own lock. torch's pluggable allocator
 * needs plain C functions without a context argument, so each slot also gets its own
 * pair of entry points, gb_arena_malloc_<slot> / gb_arena_free_<slot>.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define GB_MAX_EXTENTS 64
#define GB_MAX_SLOTS 64

enum {
    GB_OK = 0,
    GB_BAD_SLOT = -1,
    GB_TOO_MANY_EXTENTS = -2,
    GB_BAD_SIZE = -3,
    GB_MISALIGNED = -4,
    GB_OVERLAP = -5,
    GB_BAD_ALIGN = -6,
};

typedef struct {
    pthread_mutex_t mu;
    int in_use;
    size_t n;
    uintptr_t base[GB_MAX_EXTENTS];
    size_t size[GB_MAX_EXTENTS];
    size_t cursor[GB_MAX_EXTENTS];
    size_t align;
    int best_fit;
    size_t freed;
} arena_t;

static arena_t arenas[GB_MAX_SLOTS];
static pthread_mutex_t slots_mu = PTHREAD_MUTEX_INITIALIZER;

static arena_t *slot_arena(int slot) {
    if (slot < 0 || slot >= GB_MAX_SLOTS || !arenas[slot].in_use) return NULL;
    return &arenas[slot];
}

static size_t align_up(size_t n, size_t align) { return (n + align - 1) / align * align; }

int gb_arena_max_slots(void) { return GB_MAX_SLOTS; }
int gb_arena_max_extents(void) { return GB_MAX_EXTENTS; }

/* Claim a free slot with fresh state; -1 when all are taken. */
int gb_arena_acquire(int align, int best_fit) {
    int slot = -1;
    pthread_mutex_lock(&slots_mu);
    for (int i = 0; i < GB_MAX_SLOTS; i++) {
        if (!arenas[i].in_use) {
            arena_t *a = &arenas[i];
            pthread_mutex_init(&a->mu, NULL);
            a->in_use = 1;
            a->n = 0;
            a->align = align > 0 ? (size_t)align : 512;
            a->best_fit = best_fit;
            a->freed = 0;
            slot = i;
            break;
        }
    }
    pthread_mutex_unlock(&slots_mu);
    return slot;
}

void gb_arena_release(int slot) {
    pthread_mutex_lock(&slots_mu);
    if (slot >= 0 && slot < GB_MAX_SLOTS && arenas[slot].in_use) {
        arenas[slot].in_use = 0;
        arenas[slot].n = 0;
        pthread_mutex_destroy(&arenas[slot].mu);
    }
    pthread_mutex_unlock(&slots_mu);
}

/* Replace the extents, reset every cursor and the freed counter. Validates everything
 * before touching state, so a rejected call changes nothing. */
int gb_arena_set_extents(int slot, const uintptr_t *bases, const size_t *sizes, size_t n) {
    arena_t *a = slot_arena(slot);
    if (!a) return GB_BAD_SLOT;
    if (n > GB_MAX_EXTENTS) return GB_TOO_MANY_EXTENTS;
    pthread_mutex_lock(&a->mu);
    for (size_t i = 0; i < n; i++) {
        if (sizes[i] == 0 || bases[i] + sizes[i] < bases[i]) { pthread_mutex_unlock(&a->mu); return GB_BAD_SIZE; }
        if (bases[i] % a->align) { pthread_mutex_unlock(&a->mu); return GB_MISALIGNED; }
        for (size_t j = 0; j < i; j++) {
            if (bases[i] < bases[j] + sizes[j] && bases[j] < bases[i] + sizes[i]) {
                pthread_mutex_unlock(&a->mu);
                return GB_OVERLAP;
            }
        }
    }
    for (size_t i = 0; i < n; i++) {
        a->base[i] = bases[i];
        a->size[i] = sizes[i];
        a->cursor[i] = 0;
    }
    a->n = n;
    a->freed = 0;
    pthread_mutex_unlock(&a->mu);
    return GB_OK;
}

int gb_arena_set_align(int slot, size_t align) {
    arena_t *a = slot_arena(slot);
    if (!a) return GB_BAD_SLOT;
    if (align == 0 || (align & (align - 1))) return GB_BAD_ALIGN;
    pthread_mutex_lock(&a->mu);
    a->align = align;
    pthread_mutex_unlock(&a->mu);
    return GB_OK;
}

int gb_arena_set_best_fit(int slot, int best_fit) {
    arena_t *a = slot_arena(slot);
    if (!a) return GB_BAD_SLOT;
    pthread_mutex_lock(&a->mu);
    a->best_fit = best_fit != 0;
    pthread_mutex_unlock(&a->mu);
    return GB_OK;
}

/* Best fit: the extent with the least room left that still fits (earliest on a tie).
 * First fit: the first extent in list order that fits. 0 when nothing fits. */
void *gb_arena_malloc(int slot, size_t nbytes) {
    arena_t *a = slot_arena(slot);
    if (!a) return NULL;
    pthread_mutex_lock(&a->mu);
    size_t need = align_up(nbytes ? nbytes : 1, a->align);
    size_t pick = a->n, pick_room = 0;
    for (size_t i = 0; i < a->n; i++) {
        size_t room = a->size[i] - a->cursor[i];
        if (room < need) continue;
        if (!a->best_fit) { pick = i; break; }
        if (pick == a->n || room < pick_room) { pick = i; pick_room = room; }
    }
    void *p = NULL;
    if (pick < a->n) {
        p = (void *)(a->base[pick] + a->cursor[pick]);
        a->cursor[pick] += need;
    }
    pthread_mutex_unlock(&a->mu);
    return p;
}

void gb_arena_free(int slot, void *ptr, size_t nbytes) {
    (void)ptr;
    arena_t *a = slot_arena(slot);
    if (!a) return;
    pthread_mutex_lock(&a->mu);
    a->freed += nbytes;
    pthread_mutex_unlock(&a->mu);
}

#define GB_QUERY(name, expr)                         \
    size_t gb_arena_##name(int slot) {               \
        arena_t *a = slot_arena(slot);               \
        if (!a) return 0;                            \
        pthread_mutex_lock(&a->mu);                  \
        size_t v = (expr);                           \
        pthread_mutex_unlock(&a->mu);                \
        return v;                                    \
    }

static size_t sum_cursors(const arena_t *a) {
    size_t s = 0;
    for (size_t i = 0; i < a->n; i++) s += a->cursor[i];
    return s;
}

GB_QUERY(cursor, sum_cursors(a))
GB_QUERY(freed, a->freed)
GB_QUERY(align, a->align)
GB_QUERY(best_fit, (size_t)a->best_fit)
GB_QUERY(num_extents, a->n)

/* Address of the freed counter: callers poll it every step, a plain read is enough
 * for "has anything been released since set_extents" (the counter only grows). */
const size_t *gb_arena_freed_ptr(int slot) {
    arena_t *a = slot_arena(slot);
    return a ? &a->freed : NULL;
}

/* Per-extent cursor, for inspection and tests. */
size_t gb_arena_extent_cursor(int slot, size_t i) {
    arena_t *a = slot_arena(slot);
    if (!a) return 0;
    pthread_mutex_lock(&a->mu);
    size_t v = i < a->n ? a->cursor[i] : 0;
    pthread_mutex_unlock(&a->mu);
    return v;
}

/* Entry points in the signature torch.cuda.memory.CUDAPluggableAllocator expects:
 * void* malloc(ssize_t size, int device, cudaStream_t stream) and
 * void free(void* ptr, ssize_t size, int device, cudaStream_t stream). */
#define GB_SLOT(i)                                                                    \
    void *gb_arena_malloc_##i(ssize_t size, int device, void *stream) {               \
        (void)device; (void)stream;                                                   \
        return size < 0 ? NULL : gb_arena_malloc(i, (size_t)size);                   \
    }                                                                                 \
    void gb_arena_free_##i(void *ptr, ssize_t size, int device, void *stream) {       \
        (void)device; (void)stream;                                                   \
        gb_arena_free(i, ptr, size < 0 ? 0 : (size_t)size);                           \
    }

#define GB_SLOTS10(d) GB_SLOT(d##0) GB_SLOT(d##1) GB_SLOT(d##2) GB_SLOT(d##3) GB_SLOT(d##4) \
                      GB_SLOT(d##5) GB_SLOT(d##6) GB_SLOT(d##7) GB_SLOT(d##8) GB_SLOT(d##9)
GB_SLOT(0) GB_SLOT(1) GB_SLOT(2) GB_SLOT(3) GB_SLOT(4)
GB_SLOT(5) GB_SLOT(6) GB_SLOT(7) GB_SLOT(8) GB_SLOT(9)
GB_SLOTS10(1) GB_SLOTS10(2) GB_SLOTS10(3) GB_SLOTS10(4) GB_SLOTS10(5)
GB_SLOT(60) GB_SLOT(61) GB_SLOT(62) GB_SLOT(63)
