"""The course the ten notebooks make: what each teaches and how long it takes, in a three-hour
and a two-hour class.

One table, read by notebook 00 (which renders it), by ``docs/teaching.md`` (whose class plan a
test compares with it) and by each notebook's ``**Time**`` line (the same test).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Lesson", "LESSONS", "PATHS", "lesson", "course_table", "path_minutes"]


@dataclass(frozen=True)
class Lesson:
    """One notebook of the course.

    ``minutes``: its time in the three-hour class (every section); ``short``: in the two-hour
    class (0: left for homework); ``short_plan``: what the two-hour class does with it.
    """

    notebook: str
    title: str
    minutes: int
    short: int
    teaches: str
    short_plan: str


LESSONS = (
    Lesson("00_overview", "overview", 10, 10,
           "the problem on the H200's numbers; one borrow takes no device memory, while `memory_reserved` "
           "counts it twice", "all of it"),
    Lesson("01_free_runs", "free runs", 20, 20,
           "two graphs captured into one `graph_pool_handle()`, a segment of `memory_snapshot()`; free runs "
           "against whole segments; capture order; real model code",
           "pass over *Your own model code* (homework)"),
    Lesson("02_borrowing", "borrowing", 20, 20,
           "a `MemPool` over a `CUDAPluggableAllocator` and `use_mem_pool`, then `BorrowState`: capacity, "
           "where tensors land, best against first fit, a memory history for memory_viz",
           "the best/first-fit host calls are read, not run"),
    Lesson("03_deferred_frees", "deferred frees", 15, 10,
           "`record_stream`, `active_pending_free`, a measured two-stream timeline, why retirement "
           "synchronises, stream pinning", "pass over stream pinning"),
    Lesson("04_capture_retirement", "capture and retirement", 15, 10,
           "the owner slot, leak detection, an escaped borrow overwritten by replay",
           "pass over the capture that retires the pool"),
    Lesson("05_eagle_sampling", "EAGLE sampling", 25, 20,
           "tree verification in borrowed memory: a step refused, standard, lean and chunked agree; "
           "chi-square of the first and second token", "pass over the fused kernels' table"),
    Lesson("06_capacity_sweep", "capacity", 20, 15,
           "which steps fit (checked by running the boundary), size classes, fit policy, your own "
           "snapshot, a sweep's table", "pass over the sweep and the H200 table"),
    Lesson("07_explorer", "explorer", 15, 0,
           "an interactive memory map and capacity grid (ipywidgets), with static figures",
           "homework: move the controls"),
    Lesson("08_why_not_borrow", "why not borrow", 20, 15,
           "why upstream stopped borrowing for EAGLE: library workspaces, kept masks, the lean verifier; "
           "when borrowing pays", "pass over the rehearsal"),
    Lesson("09_whole_loop", "the whole loop", 20, 0,
           "speculative decoding end to end with transformers models: memory over the steps with borrowing off "
           "and on, acceptance against draft agreement, what upstream's choice costs on the H200",
           "homework: run it after class"),
)

# the two classes: name -> total minutes
PATHS = {"three-hour class": 180, "two-hour class": 120}


def lesson(notebook: str) -> Lesson:
    """The lesson of ``notebook`` (its number, ``"05"``, or its name).

    Raises:
        KeyError: no notebook of the course has that number or name.
    """
    for item in LESSONS:
        if item.notebook == notebook or item.notebook[:2] == notebook:
            return item
    raise KeyError(f"{notebook!r} is no notebook of the course; they are {[x.notebook for x in LESSONS]}")


def path_minutes(path: str) -> dict:
    """``{notebook: minutes}`` of one class (``PATHS``'s names); notebooks it leaves out are absent."""
    if path not in PATHS:
        raise KeyError(f"{path!r} is not a class; choose one of {list(PATHS)}")
    long = path == "three-hour class"
    return {x.notebook: (x.minutes if long else x.short) for x in LESSONS if (x.minutes if long else x.short)}


def course_table(links: bool = True) -> str:
    """The course as a Markdown table: notebook, minutes in each class, what it teaches.

    Args:
        links: link each notebook's name to its file (for a notebook in the same folder).
    """
    rows = ["| notebook | three hours | two hours | teaches |", "|---|---|---|---|"]
    for x in LESSONS:
        name = f"{x.notebook[:2]} {x.title}"
        cell = f"[{name}]({x.notebook}.ipynb)" if links else name
        rows.append(f"| {cell} | {x.minutes} | {x.short or 'homework'} | {x.teaches} |")
    return "\n".join(rows)
