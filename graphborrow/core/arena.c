/*
 * A multi-extent bump arena.
 *
 * The caller hands over up to GB_MAX_EXTENTS address ranges it owns (the idle free
 * runs of a CUDA-graph pool); malloc carves aligned pieces from them and never reuses
 * anything. Reuse is the job of the caching allocator above (a torch MemPool), which
 * only asks for whole segments. free only counts bytes, so the caller can see that the
 * caching layer released segments (e.g. empty_cache) and rebuild.
 *
 * Every allocation since the last set_extents is recorded (pointer -> size, an
 * open-addressing table), so a free is checked: a double, unknown or stale pointer,
 * a size other than the one malloc was asked for, or a negative size changes nothing
 * and is counted as an error with its details. Host callers get the error code back;
 * torch's pluggable path cannot raise, so its errors are only counted, and the
 * Python side reads the counter.
 *
 * All arithmetic on addresses and sizes is checked: a request too large to align,
 * or one that would run past an extent or past the end of the address space, gets 0.
 *
 * Every instance lives in its own slot with its own lock. torch's pluggable allocator
 * needs plain C functions without a context argument, so each slot also gets its own
 * pair of entry points, gb_arena_malloc_<slot> / gb_arena_free_<slot>.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
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
    GB_EXTENT_WRAPS = -7,
    GB_NULL_BASE = -8,
    GB_NO_MEMORY = -9,
    /* free errors */
    GB_FREE_NEGATIVE = -10,
    GB_FREE_UNKNOWN = -11, /* never handed out since the last set_extents (unknown or stale) */
    GB_FREE_TWICE = -12,   /* inside the carved part of an extent but not live: freed already */
    GB_FREE_SIZE = -13,    /* live, but malloc was asked for another size */
};

/* One live allocation; ptr 0 marks an empty slot of the table. */
typedef struct {
    uintptr_t ptr;
    size_t size;
} live_t;

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
    /* live allocations: linear probing, capacity a power of two, at most half full */
    live_t *live;
    size_t live_cap;
    size_t live_count;
    /* free and malloc errors: a count, and the last one's details */
    size_t errors;
    int last_error;
    uintptr_t last_error_ptr;
    int64_t last_error_size;
    size_t last_error_live_size;
} arena_t;

static arena_t arenas[GB_MAX_SLOTS];
static pthread_mutex_t slots_mu = PTHREAD_MUTEX_INITIALIZER;

static arena_t *slot_arena(int slot) {
    if (slot < 0 || slot >= GB_MAX_SLOTS || !arenas[slot].in_use) return NULL;
    return &arenas[slot];
}

static int is_power_of_two(size_t x) { return x != 0 && (x & (x - 1)) == 0; }

/* n rounded up to a multiple of align (a power of two); 0 when that overflows. */
static size_t align_up(size_t n, size_t align) {
    if (n > SIZE_MAX - (align - 1)) return 0;
    return (n + align - 1) & ~(align - 1);
}

/* ------------------------------------------------------------------ live table */

static size_t hash_ptr(uintptr_t p, size_t cap) {
    uint64_t h = (uint64_t)p;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    return (size_t)h & (cap - 1);
}

static size_t live_find(const arena_t *a, uintptr_t p) {
    if (a->live_cap == 0 || p == 0) return SIZE_MAX; /* 0 marks an empty entry, never a live one */
    for (size_t i = hash_ptr(p, a->live_cap);; i = (i + 1) & (a->live_cap - 1)) {
        if (a->live[i].ptr == p) return i;
        if (a->live[i].ptr == 0) return SIZE_MAX;
    }
}

static void live_put(live_t *table, size_t cap, uintptr_t p, size_t size) {
    size_t i = hash_ptr(p, cap);
    while (table[i].ptr != 0) i = (i + 1) & (cap - 1);
    table[i].ptr = p;
    table[i].size = size;
}

/* Room for one more entry at load <= 1/2; 0 on success. */
static int live_reserve(arena_t *a) {
    if (2 * (a->live_count + 1) <= a->live_cap) return 0;
    size_t cap = a->live_cap ? 2 * a->live_cap : 64;
    live_t *table = calloc(cap, sizeof(live_t));
    if (!table) return -1;
    for (size_t i = 0; i < a->live_cap; i++)
        if (a->live[i].ptr) live_put(table, cap, a->live[i].ptr, a->live[i].size);
    free(a->live);
    a->live = table;
    a->live_cap = cap;
    return 0;
}

/* Remove entry i, shifting later entries of its probe chain back (no tombstones). */
static void live_remove(arena_t *a, size_t i) {
    size_t mask = a->live_cap - 1;
    size_t j = i;
    for (;;) {
        a->live[i].ptr = 0;
        for (;;) {
            j = (j + 1) & mask;
            if (a->live[j].ptr == 0) {
                a->live_count--;
                return;
            }
            size_t home = hash_ptr(a->live[j].ptr, a->live_cap);
            /* entry j may move to i when its home is not in the cyclic range (i, j] */
            if (i <= j ? (home <= i || home > j) : (home <= i && home > j)) break;
        }
        a->live[i] = a->live[j];
        i = j;
    }
}

static void live_clear(arena_t *a) {
    if (a->live) memset(a->live, 0, a->live_cap * sizeof(live_t));
    a->live_count = 0;
}

static void record_error(arena_t *a, int code, uintptr_t p, int64_t size, size_t live_size) {
    a->errors++;
    a->last_error = code;
    a->last_error_ptr = p;
    a->last_error_size = size;
    a->last_error_live_size = live_size;
}

/* ------------------------------------------------------------------ slots */

int gb_arena_max_slots(void) { return GB_MAX_SLOTS; }
int gb_arena_max_extents(void) { return GB_MAX_EXTENTS; }

/* Claim a free slot with fresh state; -1 when all are taken, GB_BAD_ALIGN unless align is a
 * power of two. align is a size_t, as in gb_arena_set_align: no width between the two. */
int gb_arena_acquire(size_t align, int best_fit) {
    if (!is_power_of_two(align)) return GB_BAD_ALIGN;
    int slot = -1;
    pthread_mutex_lock(&slots_mu);
    for (int i = 0; i < GB_MAX_SLOTS; i++) {
        if (!arenas[i].in_use) {
            arena_t *a = &arenas[i];
            memset(a, 0, sizeof(*a));
            pthread_mutex_init(&a->mu, NULL);
            a->in_use = 1;
            a->align = align;
            a->best_fit = best_fit != 0;
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
        arena_t *a = &arenas[slot];
        a->in_use = 0;
        a->n = 0;
        free(a->live);
        a->live = NULL;
        a->live_cap = a->live_count = 0;
        pthread_mutex_destroy(&a->mu);
    }
    pthread_mutex_unlock(&slots_mu);
}

/* Replace the extents; reset every cursor, the freed counter and the live record.
 * Validates everything before touching state, so a rejected call changes nothing. */
int gb_arena_set_extents(int slot, const uint64_t *bases, const size_t *sizes, size_t n) {
    arena_t *a = slot_arena(slot);
    if (!a) return GB_BAD_SLOT;
    if (n > GB_MAX_EXTENTS) return GB_TOO_MANY_EXTENTS;
    pthread_mutex_lock(&a->mu);
    int code = GB_OK;
    for (size_t i = 0; i < n && code == GB_OK; i++) {
        if (bases[i] > UINTPTR_MAX) code = GB_EXTENT_WRAPS;
        else if (sizes[i] == 0) code = GB_BAD_SIZE;
        else if (bases[i] == 0) code = GB_NULL_BASE;
        /* the last byte must be addressable: base + size - 1 <= UINTPTR_MAX, and the end
         * itself representable, so cursor arithmetic never wraps */
        else if ((uintptr_t)bases[i] > UINTPTR_MAX - sizes[i]) code = GB_EXTENT_WRAPS;
        else if (bases[i] % a->align) code = GB_MISALIGNED;
        for (size_t j = 0; j < i && code == GB_OK; j++)
            if (bases[i] < bases[j] + sizes[j] && bases[j] < bases[i] + sizes[i]) code = GB_OVERLAP;
    }
    if (code == GB_OK) {
        for (size_t i = 0; i < n; i++) {
            a->base[i] = (uintptr_t)bases[i];
            a->size[i] = sizes[i];
            a->cursor[i] = 0;
        }
        a->n = n;
        a->freed = 0;
        live_clear(a);
    }
    pthread_mutex_unlock(&a->mu);
    return code;
}

int gb_arena_set_align(int slot, size_t align) {
    arena_t *a = slot_arena(slot);
    if (!a) return GB_BAD_SLOT;
    if (!is_power_of_two(align)) return GB_BAD_ALIGN;
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

/* ------------------------------------------------------------------ malloc / free */

/* Where a request of `need` aligned bytes would start in extent i, or 0 if it does not fit.
 * The start is aligned itself (not only the cursor), so raising align after set_extents
 * still yields aligned pointers; the skipped bytes count as carved. */
static uintptr_t fit_in(const arena_t *a, size_t i, size_t need, size_t *room_after) {
    uintptr_t end = a->base[i] + a->size[i]; /* cannot wrap: checked by set_extents */
    uintptr_t at = a->base[i] + a->cursor[i];
    uintptr_t start = (uintptr_t)align_up((size_t)at, a->align);
    if (start == 0 || start < at || start > end || end - start < need) return 0;
    *room_after = end - start - need;
    return start;
}

/* Best fit: the extent with the least room left that still fits (earliest on a tie).
 * First fit: the first extent in list order that fits. 0 when nothing fits. */
void *gb_arena_malloc(int slot, size_t nbytes) {
    arena_t *a = slot_arena(slot);
    if (!a) return NULL;
    pthread_mutex_lock(&a->mu);
    size_t need = align_up(nbytes ? nbytes : 1, a->align);
    size_t pick = a->n, pick_room = 0;
    uintptr_t pick_start = 0;
    if (need != 0) {
        for (size_t i = 0; i < a->n; i++) {
            size_t room_after;
            uintptr_t start = fit_in(a, i, need, &room_after);
            if (!start) continue;
            if (pick == a->n || room_after < pick_room) {
                pick = i;
                pick_room = room_after;
                pick_start = start;
            }
            if (!a->best_fit) break;
        }
    }
    void *p = NULL;
    if (pick < a->n) {
        if (live_reserve(a) == 0) {
            live_put(a->live, a->live_cap, pick_start, nbytes);
            a->live_count++;
            a->cursor[pick] = pick_start - a->base[pick] + need;
            p = (void *)pick_start;
        } else {
            record_error(a, GB_NO_MEMORY, pick_start, (int64_t)nbytes, 0);
        }
    }
    pthread_mutex_unlock(&a->mu);
    return p;
}

/* Check a free against the live record; count the bytes only if it is valid.
 * Returns GB_OK or the error (also recorded in the slot's error counter). */
int gb_arena_free_checked(int slot, void *ptr, int64_t nbytes) {
    arena_t *a = slot_arena(slot);
    if (!a) return GB_BAD_SLOT;
    uintptr_t p = (uintptr_t)ptr;
    int code = GB_OK;
    size_t live_size = 0;
    pthread_mutex_lock(&a->mu);
    size_t i = live_find(a, p);
    if (nbytes < 0) {
        code = GB_FREE_NEGATIVE;
    } else if (i == SIZE_MAX) {
        code = GB_FREE_UNKNOWN;
        for (size_t e = 0; e < a->n; e++)
            if (p >= a->base[e] && p - a->base[e] < a->cursor[e]) code = GB_FREE_TWICE;
    } else if (a->live[i].size != (size_t)nbytes) {
        code = GB_FREE_SIZE;
        live_size = a->live[i].size;
    }
    if (code == GB_OK) {
        live_remove(a, i);
        a->freed += (size_t)nbytes;
    } else {
        record_error(a, code, p, nbytes, live_size);
    }
    pthread_mutex_unlock(&a->mu);
    return code;
}

void gb_arena_free(int slot, void *ptr, size_t nbytes) {
    gb_arena_free_checked(slot, ptr, nbytes > (size_t)INT64_MAX ? -1 : (int64_t)nbytes);
}

/* ------------------------------------------------------------------ queries */

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

static size_t sum_live(const arena_t *a) {
    size_t s = 0;
    for (size_t i = 0; i < a->live_cap; i++)
        if (a->live[i].ptr) s += a->live[i].size;
    return s;
}

GB_QUERY(cursor, sum_cursors(a))
GB_QUERY(freed, a->freed)
GB_QUERY(align, a->align)
GB_QUERY(best_fit, (size_t)a->best_fit)
GB_QUERY(num_extents, a->n)
GB_QUERY(live_count, a->live_count)
GB_QUERY(live_bytes, sum_live(a))
GB_QUERY(errors, a->errors)

/* Addresses of the freed and error counters: callers poll them every step, and a plain
 * read is enough for "has anything changed" (both counters only grow between resets). */
const size_t *gb_arena_freed_ptr(int slot) {
    arena_t *a = slot_arena(slot);
    return a ? &a->freed : NULL;
}

const size_t *gb_arena_errors_ptr(int slot) {
    arena_t *a = slot_arena(slot);
    return a ? &a->errors : NULL;
}

/* The last error: its code (0 if none), pointer, size asked, and the live size on a mismatch. */
int gb_arena_last_error(int slot, uint64_t *ptr, int64_t *size, uint64_t *live_size) {
    arena_t *a = slot_arena(slot);
    if (!a) return GB_BAD_SLOT;
    pthread_mutex_lock(&a->mu);
    int code = a->last_error;
    *ptr = a->last_error_ptr;
    *size = a->last_error_size;
    *live_size = a->last_error_live_size;
    pthread_mutex_unlock(&a->mu);
    return code;
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
 * void free(void* ptr, ssize_t size, int device, cudaStream_t stream).
 * torch frees with the size it asked for; any other free is counted, never applied. */
#define GB_SLOT(i)                                                                    \
    void *gb_arena_malloc_##i(ssize_t size, int device, void *stream) {               \
        (void)device; (void)stream;                                                   \
        return size < 0 ? NULL : gb_arena_malloc(i, (size_t)size);                   \
    }                                                                                 \
    void gb_arena_free_##i(void *ptr, ssize_t size, int device, void *stream) {       \
        (void)device; (void)stream;                                                   \
        gb_arena_free_checked(i, ptr, (int64_t)size);                                 \
    }

#define GB_SLOTS10(d) GB_SLOT(d##0) GB_SLOT(d##1) GB_SLOT(d##2) GB_SLOT(d##3) GB_SLOT(d##4) \
                      GB_SLOT(d##5) GB_SLOT(d##6) GB_SLOT(d##7) GB_SLOT(d##8) GB_SLOT(d##9)
GB_SLOT(0) GB_SLOT(1) GB_SLOT(2) GB_SLOT(3) GB_SLOT(4)
GB_SLOT(5) GB_SLOT(6) GB_SLOT(7) GB_SLOT(8) GB_SLOT(9)
GB_SLOTS10(1) GB_SLOTS10(2) GB_SLOTS10(3) GB_SLOTS10(4) GB_SLOTS10(5)
GB_SLOT(60) GB_SLOT(61) GB_SLOT(62) GB_SLOT(63)
