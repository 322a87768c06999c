"""The paper builder's placeholders that rank systems follow the results, not the author."""

from __future__ import annotations

import pytest

from experiments.paper import MissingResult, build_paper


def _build(tmp_path, rows: str, text: str) -> str:
    results = tmp_path / "results"
    results.mkdir()
    (results / "memory-cap.csv").write_text("system,ranks,max_seq_len\n" + rows)
    source = tmp_path / "paper.md"
    source.write_text(text)
    out = build_paper(results, tmp_path / "build", source=source)
    return out.read_text()


@pytest.mark.parametrize(("autosp", "baseline", "word"), [
    ("1536", "2304", "smaller than"), ("2304", "1536", "larger than"), ("1,280", "1280", "equal to"),
])
def test_paper_compare_placeholder_ranks_two_systems_from_the_results(tmp_path, autosp, baseline, word):
    rows = f'autosp,2,"{autosp}"\nulysses+ckpt,2,{baseline}\n'
    text = _build(tmp_path, rows, "AutoSP's is {{compare:memory-cap:ranks=2:max_seq_len:autosp:ulysses+ckpt}} it.")
    assert f"AutoSP's is {word} it." in text


def test_paper_compare_placeholder_refuses_a_missing_number(tmp_path):
    with pytest.raises(MissingResult, match="not a number"):
        _build(tmp_path, "autosp,2,\nulysses+ckpt,2,1\n", "{{compare:memory-cap::max_seq_len:autosp:ulysses+ckpt}}")
