"""Dataset keys such as imagenet_c:fog:3 hold a rich emoji code (":fog:"). rich turns such codes into emoji by
default; no console of the project may do so (help texts, progress lines, warnings, tables)."""

import io
import re
from pathlib import Path

from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]
KEY = "imagenet_c:fog:3"


def test_rich_would_replace_the_key_by_default():
    buf = io.StringIO()
    Console(file=buf).print(KEY)
    assert KEY not in buf.getvalue()  # the hazard guarded against here is real


def test_extract_progress_keeps_imagenet_c_keys(capsys):
    from extract.run.progress import Progress as _Progress

    with _Progress(True) as prog:
        task = prog.task(f"encoding {KEY} (single)", 1)
        task.advance(1)
        prog.print(f"note on {KEY}")
    out = capsys.readouterr().out
    assert f"note on {KEY}" in out and "\N{FOG}" not in out


def test_every_console_of_the_project_has_emoji_off():
    found = []
    for path in [*ROOT.glob("extract/**/*.py"), *ROOT.glob("calibrate/**/*.py")]:
        for call in re.findall(r"\bConsole\([^)]*\)", path.read_text()):
            found.append((path.name, call))
    assert found, "no Console() found: the pattern is stale"
    assert [f for f in found if "emoji=False" not in f[1]] == []
