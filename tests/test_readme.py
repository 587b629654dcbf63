"""Every Python block of the README and of the docs pages it links for usage runs as written
(each in a fresh namespace, on the CPU)."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = ("README.md", "docs/api.md", "docs/jax.md")
BLOCKS = [
    (page, i, block)
    for page in PAGES
    for i, block in enumerate(re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), re.S))
]


def test_readme_has_python_blocks():
    assert [p for p, _, _ in BLOCKS].count("README.md") >= 1 and len(BLOCKS) >= 5


@pytest.mark.parametrize("page, index, block", BLOCKS, ids=[f"{p}-{i}" for p, i, _ in BLOCKS])
def test_readme_python_block_runs(page, index, block, monkeypatch):
    monkeypatch.setenv("MOE_BWD_BACKEND", "auto")
    exec(compile(block, f"{page} python block {index}", "exec"), {"__name__": "readme"})


def test_readme_is_short_and_names_no_tracker_numbers():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    assert not re.search(r"\bissue \d+|\brun \d+\b|\bsession-\d+|the seed's", text)


def test_nki_results_rows_name_what_the_kernel_computes():
    """The NKI backends refuse gpt-oss's activation: no row of the NKI results table may call
    its shape "gpt-oss-like"; the clamped, biased SwiGLU row says it is SwiGLU."""
    text = (ROOT / "docs" / "hardware.md").read_text()
    table = text[text.index("NKI MXFP8 kernel on the interpreter"):]
    rows = [line for line in table.split("\n\n")[1].splitlines() if line.startswith("|")]
    assert rows and not any("gpt-oss-like" in r for r in rows)
    assert any(r.startswith("| SwiGLU with clamp 7 and biases") for r in rows)


def test_quick_start_time_is_a_range_a_fresh_two_core_run_meets():
    """A fresh 2-core run of the quick start took 136 s: the stated range must hold it."""
    text = README.read_text()
    m = re.search(r"takes (\d+(?:\.\d+)?)–(\d+(?:\.\d+)?) minutes on 2 CPU cores", text)
    assert m, "the quick start states its time as 'takes A–B minutes on 2 CPU cores'"
    assert float(m.group(1)) * 60 <= 136 <= float(m.group(2)) * 60
