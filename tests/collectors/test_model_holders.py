"""The agent keeps sampling a process it once saw holding a model file, after the process closes it.

Why it matters: preload-per-worker code reads the checkpoint into private memory and closes the
file; the duplicate-copies rule needs those workers' memory for the rest of the window, even when
they are too small to be in the top-N by RSS.
"""

from __future__ import annotations

from pathlib import Path

from collectors.processes import ProcessSampler
from tests.collectors.proc_builders import make_proc
from tests.collectors.proc_builders import maps_line as _maps_line


def test_a_former_holder_stays_sampled_after_closing_the_file(tmp_path: Path) -> None:
    for pid in range(100, 105):  # bigger processes fill the top-N
        make_proc(tmp_path, pid, rss_pages=pid * 100)
    holder = make_proc(tmp_path, 50, rss_pages=1, maps=_maps_line("/models/llama.safetensors"))
    never = make_proc(tmp_path, 51, rss_pages=1)
    sampler = ProcessSampler(tmp_path, top_n=2, model_rescan_s=1.0)
    first = {s.pid: s for s in sampler.sample(now=10.0)}
    assert first[50].model_files == ["/models/llama.safetensors"] and 51 not in first

    (holder / "maps").write_text("")  # the worker closed (unmapped) the checkpoint
    later = {s.pid: s for s in sampler.sample(now=20.0)}
    assert 50 in later and later[50].model_files == []  # still sampled, and honest about what it holds now
    assert 51 not in later
    assert never.exists()
