#!/usr/bin/env python
"""Seconds each test file took, from a pytest JUnit report, as ``tests/durations.json``.

    python -m pytest -q --junitxml=/tmp/suite.xml
    python scripts/test_durations.py /tmp/suite.xml > tests/durations.json

``tests/conftest.py`` starts the longest files first, so that pytest-xdist's workers (``--dist loadfile``
hands out whole files in collection order) finish together: the longest-processing-time-first rule.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def file_seconds(report: Path) -> dict[str, float]:
    """Per test file (``tests/<package>/test_x.py``), the sum of its test cases' times, longest first."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(report).getroot().iter("testcase"):
        module = (case.get("classname") or "").split(".")
        name = next((f"{'/'.join(module[:i + 1])}.py" for i, part in enumerate(module) if part.startswith("test_")), None)
        if name is not None:
            seconds[name] += float(case.get("time") or 0.0)
    return {k: round(v, 1) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(file_seconds(Path(args[0])), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
