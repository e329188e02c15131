"""The contracts are documented: every service, rpc, message, field and enum value in protos/
has a comment (on its line or the line above)."""

from __future__ import annotations

import re
from pathlib import Path

PROTOS = Path(__file__).resolve().parent.parent / "protos"
DECLARATION = re.compile(
    r"^\s*(?:(?:repeated|optional)\s+)?(?:map<[\w.,\s]+>|[\w.]+)\s+\w+\s*=\s*\d+\s*;"  # a field
    r"|^\s*\w+\s*=\s*\d+\s*;"  # an enum value
    r"|^\s*(?:message|enum|service|rpc)\s+\w+"
)


def undocumented(text: str) -> list[str]:
    lines = text.splitlines()
    return [
        f"{i + 1}: {line.strip()}"
        for i, line in enumerate(lines)
        if DECLARATION.match(line)
        and "//" not in line
        and not (i and lines[i - 1].strip().startswith("//"))
    ]


def test_the_checker_sees_an_undocumented_field():
    proto = "// A thing.\nmessage Thing {\n  uint32 size = 1;  // bytes\n  string name = 2;\n}\n"
    assert undocumented(proto) == ["4: string name = 2;"]


def test_every_declaration_in_the_protos_has_a_comment():
    missing = {
        path.name: found
        for path in sorted(PROTOS.rglob("*.proto"))
        if (found := undocumented(path.read_text()))
    }
    assert not missing, f"undocumented in protos/: {missing}"
