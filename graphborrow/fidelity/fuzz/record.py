"""Run a program here and record what the allocator did: the GPU side of the differential test.

A program runs through ``torch.cuda`` (a real GPU, or the simulated device when
:func:`graphborrow.sim.cuda_api.simulated_cuda` answers it) with memory history on from its
first line. Its *recording* (:func:`graphborrow.fidelity.compare.recording`) holds every
segment of every pool at the end, the allocator trace with, per event, the program line
that made it, the error the program stopped with (type, first line of the message, line,
and the exceptions it was raised while handling) and where it ran. This module imports
neither the simulator nor anything heavy, so a GPU child process starts quickly.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Optional

import torch

from graphborrow.fidelity.compare import recording, save_recording

from .generate import Program

__all__ = ["MAX_ENTRIES", "execute", "make_recording", "record_here", "start_history"]

MAX_ENTRIES = 400_000
_ALLOC_ACTIONS = ("segment_alloc", "alloc", "free_completed", "segment_free", "free_requested")


def _first_line(text: str) -> str:
    return str(text).strip().splitlines()[0] if str(text).strip() else ""


def _program_line(tb, filename: str) -> int:
    line = 0
    for frame in traceback.extract_tb(tb):
        if frame.filename == filename:
            line = frame.lineno
    return line


def _describe_error(exc: BaseException, filename: str) -> dict:
    chain, seen, current = [], set(), exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append({"type": type(current).__name__, "message": _first_line(current),
                      "line": _program_line(current.__traceback__, filename)})
        current = current.__cause__ or current.__context__
    return {**chain[0], "text": str(exc)[:2000], "chain": chain[1:]}


def execute(program: Program, namespace: dict) -> Optional[dict]:
    """Run ``program``'s source here (whatever ``torch.cuda`` currently is).

    Args:
        program: the program to run.
        namespace: its globals; the caller clears them once it has taken its snapshot (the
            tensors the program kept are part of the pool it leaves).

    Returns:
        None when it ran to the end, else its error: ``type``, ``message`` (first line),
        ``line`` (the program line it was raised at) and ``chain`` (the exceptions it was
        raised while handling, innermost last), so two devices can be compared.
    """
    code = compile(program.source, program.filename, "exec")
    namespace.setdefault("__name__", "__graphborrow_program__")
    try:
        exec(code, namespace)
    except Exception as exc:  # the error is the result
        return _describe_error(exc, program.filename)
    return None


def _trace_lines(entries, filename: str) -> list[int]:
    """Per allocator event, the innermost program line in its frames (0 for none)."""
    lines = []
    for e in entries:
        if e.get("action") not in _ALLOC_ACTIONS:
            continue
        line = 0
        for f in e.get("frames", ()) or ():
            if f.get("filename") == filename:
                line = int(f.get("line", 0))
                break
        lines.append(line)
    return lines


def make_recording(program: Program, snapshot: dict, error: Optional[dict], device: str, **fields) -> dict:
    entries = snapshot["device_traces"][0] if snapshot.get("device_traces") else []
    rec = recording(snapshot["segments"], entries, name=program.name, kind=program.kind, seed=program.seed,
                    settings=program.settings, source=program.source, error=error, device=device,
                    torch=torch.__version__, allocator_settings=snapshot.get("allocator_settings", {}), **fields)
    rec["lines"] = _trace_lines(entries, program.filename)
    return rec


def start_history(cuda) -> None:
    cuda.memory._record_memory_history("all", context="alloc", stacks="python", max_entries=MAX_ENTRIES)


_SDP_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


def _watch_attention(choices: dict):
    """Note which backend CUDA picks for each attention call (a host-side query); returns the undo."""
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                     enable_gqa=False):
        key = repr((tuple(q.shape), tuple(k.shape), str(q.dtype), None if attn_mask is None else
                    (str(attn_mask.dtype), tuple(attn_mask.shape)), bool(is_causal), bool(enable_gqa),
                    tuple(t.stride(-1) for t in (q, k, v))))
        try:
            choice = _SDP_NAMES.get(int(torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                                                enable_gqa=enable_gqa)), "error")
        except Exception as exc:  # no kernel takes these inputs: the call itself will say so
            choice = f"error: {type(exc).__name__}"
        choices.setdefault(key, choice)
        return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)

    functional.scaled_dot_product_attention = scaled_dot_product_attention
    return lambda: setattr(functional, "scaled_dot_product_attention", original)


def record_here(program: Program) -> dict:
    """Run ``program`` on this process's GPU and record it (call in a fresh process).

    The allocator setting must already be in ``PYTORCH_CUDA_ALLOC_CONF`` (it is read when
    CUDA starts). Returns the recording.
    """
    cuda = torch.cuda
    cuda.init()
    choices: dict = {}
    undo = _watch_attention(choices)
    start_history(cuda)
    namespace: dict = {}
    error = execute(program, namespace)
    undo()
    try:
        cuda.synchronize()
    except Exception:  # a program that failed inside a capture may leave the stream broken
        pass
    try:
        snapshot = cuda.memory._snapshot()
    except Exception as exc:  # keep what the program said; the pools are then unknown
        snapshot = {"segments": [], "device_traces": [[]], "snapshot_error": f"{type(exc).__name__}: {exc}"}
    capturing = _still_capturing(cuda)
    cuda.memory._record_memory_history(None)
    namespace.clear()
    return make_recording(program, snapshot, error, cuda.get_device_name(), cuda_version=torch.version.cuda,
                          cudnn=torch.backends.cudnn.version(), total_memory=cuda.mem_get_info()[1],
                          still_capturing=capturing, snapshot_error=snapshot.get("snapshot_error"),
                          sdpa_choices=[[k, v] for k, v in choices.items()])


def _still_capturing(cuda) -> bool | str:
    try:
        return bool(cuda.is_current_stream_capturing())
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def main_child(spec: str) -> int:
    """Record one program given as JSON (``Program`` fields plus ``out``) on this GPU; print a summary line."""
    fields = json.loads(spec)
    out = Path(fields.pop("out"))
    program = Program(**fields)
    rec = record_here(program)
    save_recording(rec, out / f"{program.name}.json.gz")
    print("RECORDED " + json.dumps({"name": program.name, "error": rec["error"],
                                    "events": len(rec.get("trace", ())), "segments": len(rec["segments"])}))
    sys.stdout.flush()
    return 0
