"""The docs' console examples: the paths they show and what those stand for when a test runs
them, and their ``$ command`` lines with the output shown under each."""

from __future__ import annotations

# Paths the examples show, and what they stand for when the test runs them.
SHOWN_REPO = "/src/hatch-vllm-patch"
SHOWN_WORKDIR = "/srv/demo"


def commands(body: str) -> list[tuple[str, str]]:
    """``$ command`` lines (``\\`` continues one) and the output shown under each."""
    out: list[tuple[str, list[str]]] = []
    lines = body.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("$ "):
            cmd = line[2:]
            while cmd.endswith("\\"):
                i += 1
                cmd = cmd[:-1] + lines[i].strip()
            out.append((cmd, []))
        else:
            out[-1][1].append(line)
        i += 1
    return [(cmd, "\n".join(shown)) for cmd, shown in out]
