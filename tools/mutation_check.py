"""Which plausible one-line slips the tests catch: each change of ``tools/mutations.yaml`` (a
file, an exact fragment of one of its lines, its replacement, the tests that cover it) is
applied, one at a time, to a copy of the project (src, tests, configs, tools and pyproject.toml,
the working tree as it is, uncommitted changes included), the chosen tests run on the copy with
``-x -q``, and the change is reported caught when they fail, missed when they pass:

    python tools/mutation_check.py                     # every change of tools/mutations.yaml
    python tools/mutation_check.py --only FedMut KD    # the changes whose name holds a word given
    python tools/mutation_check.py --list

Before any change, each distinct test selection runs once on the unchanged copy and must pass
(else a change would be reported caught by a test that fails anyway). The checkout itself is
never touched. Exits 1 when a change is missed or a baseline fails, 0 when all are caught.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Sequence, Tuple

import yaml

from fl_lightning.tool_parser import ToolParser

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("src", "tests", "configs", "tools", "pyproject.toml")
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", "*.egg-info")
VERDICTS = {0: "missed", 1: "caught"}  # pytest's exit codes; 2-4: interrupted or not collected


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    original: str
    replacement: str
    tests: Tuple[str, ...]


def load_mutations(path: Path) -> List[Mutation]:
    entries = yaml.safe_load(path.read_text())
    return [Mutation(e["name"], e["file"], e["from"], e["to"], tuple(e["tests"])) for e in entries]


def copy_project(dest: Path) -> None:
    for part in COPIED:
        source = ROOT / part
        if source.is_dir():
            shutil.copytree(source, dest / part, ignore=IGNORED)
        else:
            shutil.copy2(source, dest / part)


@contextmanager
def applied(copy: Path, mutation: Mutation) -> Iterator[None]:
    """The copy with ``mutation`` made (its fragment must occur exactly once), restored after."""
    path = copy / mutation.file
    text = path.read_text()
    found = text.count(mutation.original)
    if found != 1:
        raise ValueError(f"{mutation.file}: the fragment {mutation.original!r} occurs {found} times, not once")
    path.write_text(text.replace(mutation.original, mutation.replacement))
    try:
        yield
    finally:
        path.write_text(text)


def run_tests(copy: Path, tests: Sequence[str], timeout: float) -> Tuple[str, float]:
    """(verdict, seconds) of ``pytest -x -q`` on the copy, its package imported from the copy."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy / "src"), str(copy / "tests")]),
           "PYTHONDONTWRITEBYTECODE": "1"}
    started = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                              cwd=copy, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=timeout)
        verdict = VERDICTS.get(done.returncode, f"error (pytest exit {done.returncode})")
    except subprocess.TimeoutExpired:
        verdict = f"timeout ({timeout:.0f} s)"
    return verdict, time.perf_counter() - started


def imports_from(copy: Path) -> bool:
    """The copy's tests import the copy's package, not the checkout's editable install."""
    env = {**os.environ, "PYTHONPATH": str(copy / "src")}
    where = subprocess.run([sys.executable, "-c", "import fl_lightning; print(fl_lightning.__file__)"],
                           cwd=copy, env=env, capture_output=True, text=True).stdout.strip()
    return Path(where).resolve().is_relative_to(copy.resolve())


def table(rows: Sequence[Tuple[str, str, str, float]]) -> str:
    width = max(len(r[0]) for r in rows)
    lines = [f"{'change':<{width}}  {'file':<48}  {'verdict':<8}  seconds"]
    lines += [f"{name:<{width}}  {file:<48}  {verdict:<8}  {seconds:7.1f}" for name, file, verdict, seconds in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = ToolParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mutations", type=Path, default=ROOT / "tools" / "mutations.yaml",
                        help="the list of changes (YAML)")
    parser.add_argument("--only", nargs="+", default=None, help="run the changes whose name holds one of these words")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one test run may take")
    parser.add_argument("--list", action="store_true", help="list the changes and exit")
    args = parser.parse_args(argv)
    mutations = load_mutations(args.mutations)
    if args.only:
        mutations = [m for m in mutations if any(word.lower() in m.name.lower() for word in args.only)]
    if args.list or not mutations:
        for m in mutations:
            print(f"{m.name}  [{m.file}]  {' '.join(m.tests)}")
        return 0
    with tempfile.TemporaryDirectory(prefix="mutation_check_") as folder:
        copy = Path(folder)
        copy_project(copy)
        if not imports_from(copy):
            print("error: the copy's tests would import the checkout's package", file=sys.stderr)
            return 2
        failing = False
        for tests in dict.fromkeys(m.tests for m in mutations):  # each selection once, in order
            verdict, seconds = run_tests(copy, tests, args.timeout)
            print(f"baseline {' '.join(tests)}: {'passes' if verdict == 'missed' else verdict} ({seconds:.1f} s)",
                  flush=True)
            failing |= verdict != "missed"
        if failing:
            print("error: a test selection fails without any change; no change checked", file=sys.stderr)
            return 1
        rows = []
        for m in mutations:
            with applied(copy, m):
                verdict, seconds = run_tests(copy, m.tests, args.timeout)
            print(f"{verdict:<8} {m.name} ({seconds:.1f} s)", flush=True)
            rows.append((m.name, m.file.removeprefix("src/fl_lightning/"), verdict, seconds))
    caught = sum(r[2] == "caught" for r in rows)
    print(f"\n{table(rows)}\n\n{caught} of {len(rows)} changes caught")
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
