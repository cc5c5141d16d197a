"""The README's Usage examples run as printed (on the CPU here: ``device="cuda"`` becomes
``"cpu"``, where ``gemm`` dequantizes and multiplies), so a copied snippet never fails."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _usage_blocks() -> list[str]:
    text = README.read_text()
    usage = text[text.index("## Usage") : text.index("### Modules")]
    return re.findall(r"```python\n(.*?)```", usage, flags=re.S)


def test_usage_examples_run(capsys):
    blocks = _usage_blocks()
    assert len(blocks) == 2
    scope: dict = {}
    for code in blocks:
        exec(compile(code.replace('device="cuda"', 'device="cpu"'), "README", "exec"), scope)
    printed = float(capsys.readouterr().out.split()[0])
    assert abs(printed - 4.25 / 16) < 1e-3  # the comment's ratio
    assert scope["y"].shape == (1, 4096) and scope["W_hat"].shape == (4096, 2048)
