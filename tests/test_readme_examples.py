"""The README's Usage and Modules examples run as printed (on the CPU here: "cuda" becomes
"cpu", where ``gemm`` dequantizes and multiplies), so a copied snippet never fails."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks(start: str, end: str) -> list[str]:
    text = README.read_text()
    part = text[text.index(start) : text.index(end)]
    return re.findall(r"```python\n(.*?)```", part, flags=re.S)


def _run(code: str, scope: dict) -> None:
    code = code.replace('device="cuda"', 'device="cpu"').replace(".half().cuda()", "")
    exec(compile(code, "README", "exec"), scope)


def test_usage_examples_run(capsys):
    blocks = _blocks("## Usage", "### Modules")
    assert len(blocks) == 2
    scope: dict = {}
    for code in blocks:
        _run(code, scope)
    printed = float(capsys.readouterr().out.split()[0])
    assert abs(printed - 4.25 / 16) < 1e-3  # the comment's ratio
    assert scope["y"].shape == (1, 4096) and scope["W_hat"].shape == (4096, 2048)


def test_modules_example_runs(capsys, tmp_path, monkeypatch):
    from kbit_cute import KbitLinear

    (code,) = _blocks("### Modules", "### Mixture of experts")
    monkeypatch.chdir(tmp_path)  # it saves q.pt
    scope: dict = {}
    _run(code, scope)
    printed = capsys.readouterr().out
    assert "bytes=4.46 MB" in printed  # the comment's repr
    assert all(isinstance(m, KbitLinear) for m in (scope["model"][0], scope["model"][2]))
    assert (tmp_path / "q.pt").is_file()
