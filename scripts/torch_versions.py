"""Run the exactness core on several torch versions, one virtual environment each, and print (or
write into docs/torch-versions.md) the table of what each version runs.

    python scripts/torch_versions.py /tmp/venv-torch2.8.0 /tmp/venv-torch2.15.0 --write
    python scripts/torch_versions.py --matrix /tmp/zoo-torch --write   # every minor release of
                                   # the supported range, one venv each (made when absent)
    python scripts/torch_versions.py --imports /tmp/venv-torch2.5.1 ...   # `import zoo` only
    python scripts/torch_versions.py VENV --save results.jsonl   # later: --load results.jsonl

Each environment needs torch, torchvision, timm, transformers and pytest; the checkout is put on
its path (PYTHONPATH), so the code under test is this one. The core is the list of pytest files
in .ci/torch-core.txt; each file stands for one claim (a column of the table).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / ".ci" / "torch-core.txt"
PAGE = ROOT / "docs" / "torch-versions.md"
PYPROJECT = ROOT / "pyproject.toml"
#: What each environment holds besides torch (pip picks the torchvision that matches torch).
PACKAGES = ["torchvision", "timm", "transformers", "pytest", "pytest-xdist", "fire", "pyyaml",
            "tqdm", "numpy"]
BEGIN, END = "<!-- torch-versions table: begin -->", "<!-- torch-versions table: end -->"


def core_files(path: Path = CORE) -> list[tuple[str, str]]:
    """(pytest file, the claim it checks) from the core list: ``file  # claim`` per line."""
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            file, _, claim = line.partition("#")
            rows.append((file.strip(), claim.strip() or file.strip()))
    return rows


def _env(venv: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'scripts'}")
    env.pop("PIP_CONSTRAINT", None)
    return env


def torch_version(venv: Path) -> str:
    """``venv``'s torch version, with its torchvision and timm: '2.8.0+cu128 (0.23.0, 1.0.31)'."""
    code = ("import timm, torch, torchvision; print(f'{torch.__version__} "
            "({torchvision.__version__.split(\"+\")[0]}, {timm.__version__})')")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True,
                         text=True, check=True)
    return out.stdout.strip()


def floor(pyproject: Path = PYPROJECT) -> tuple[int, ...]:
    """The oldest supported torch, as pyproject.toml's dependencies say (``torch>=2.8``)."""
    return _release(re.search(r'"torch>=([\d.]+)"', pyproject.read_text()).group(1))


def releases(since: tuple[int, ...]) -> list[str]:
    """The newest patch of every torch minor release from ``since`` on, as the package index
    lists them (``pip index versions torch``, with an empty constraint file: a machine's pip
    cap must not hide the newest)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as empty:
        out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "torch"],
                             capture_output=True, text=True, check=True,
                             env=dict(os.environ, PIP_CONSTRAINT=empty.name))
    listed = re.search(r"Available versions: (.*)", out.stdout).group(1).split(", ")
    newest: dict[tuple[int, ...], str] = {}
    for version in listed:
        if re.fullmatch(r"\d+\.\d+\.\d+", version) and _release(version)[:2] >= since[:2]:
            minor = _release(version)[:2]
            if minor not in newest or _release(version) > _release(newest[minor]):
                newest[minor] = version
    return [newest[m] for m in sorted(newest)]


def make_venv(venv: Path, version: str) -> bool:
    """A virtual environment at ``venv`` holding torch ``version`` and :data:`PACKAGES`,
    installed with an empty constraint file; reused when a previous call finished it. False
    (and the reason on stderr) when the install fails (the network). ``torch===X`` asks for
    exactly that release: ``==`` also takes a local build (2.13.0+cpu from a wheel directory),
    beside which pip's torchvision does not load."""
    done = venv / ".installed"
    if done.exists():
        return True
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as empty:
        run = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"torch==={version}",
                              *PACKAGES], env=dict(os.environ, PIP_CONSTRAINT=empty.name),
                             capture_output=True, text=True)
    if run.returncode:
        tail = (run.stderr.strip().splitlines() or ["pip failed"])[-1]
        print(f"torch {version}: could not be installed in {venv}: {tail}", file=sys.stderr)
        return False
    done.touch()
    return True


def import_zoo(venv: Path) -> str:
    """'yes', or the last line of the error ``import zoo`` gives in ``venv``."""
    run = subprocess.run([str(venv / "bin" / "python"), "-c", "import zoo"], cwd=ROOT,
                         env=_env(venv), capture_output=True, text=True)
    return "yes" if run.returncode == 0 else (run.stderr.strip().splitlines() or ["fails"])[-1]


def refused(venv: Path) -> str:
    """What zoo refuses on ``venv``'s torch (``zoo._torch.refused()``), or 'nothing'."""
    code = "from zoo import _torch; print('; '.join(_torch.refused()) or 'nothing')"
    run = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=ROOT, env=_env(venv),
                         capture_output=True, text=True)
    return run.stdout.strip() if run.returncode == 0 else "-"


def run_core(venv: Path, files: list[str], extra: list[str]) -> tuple[dict[str, list[str]], float]:
    """Run the core in ``venv``: per file, the outcome of each test ('passed', 'failed',
    'skipped: reason'), and the wall time in seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "core.xml"
        start = time.perf_counter()
        subprocess.run([str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p",
                        "no:cacheprovider", f"--junitxml={xml}", *extra, *files],
                       cwd=ROOT, env=_env(venv))
        seconds = time.perf_counter() - start
        outcomes: dict[str, list[str]] = {f: [] for f in files}
        if not xml.exists():
            return outcomes, seconds
        for case in ET.parse(xml).iter("testcase"):
            name = case.get("classname", "")  # tests.checkpoint.test_x[.Class]
            key = next((f for f in files if name == f[:-3].replace("/", ".") or
                        name.startswith(f[:-3].replace("/", ".") + ".")), None)
            if key is None:
                continue
            if case.find("failure") is not None or case.find("error") is not None:
                outcomes[key].append("failed")
            elif (skip := case.find("skipped")) is not None:
                outcomes[key].append("skipped: " + (skip.get("message") or ""))
            else:
                outcomes[key].append("passed")
    return outcomes, seconds


def cell(outcomes: list[str]) -> str:
    """One table cell: 'exact (n)', 'FAILS k of n', or why it is skipped."""
    if not outcomes:
        return "not run"
    passed = outcomes.count("passed")
    failed = outcomes.count("failed")
    skipped = [o for o in outcomes if o.startswith("skipped")]
    if failed:
        return f"FAILS {failed} of {len(outcomes)}"
    needs = sorted({m.group(0) for o in skipped if (m := re.search(r"needs torch >= [\d.]+", o))})
    if not passed and needs:
        return "; ".join(needs)
    text = f"passes ({passed})"
    if needs:
        text += f", {len(skipped)} skipped ({'; '.join(needs)})"
    return text


def table(rows: list[tuple], core: list[tuple[str, str]]) -> str:
    """The markdown table of ``rows``: (version, import zoo, outcomes per file, seconds, what
    zoo refuses there)."""
    head = ["torch (torchvision, timm)", "import zoo", *(claim for _, claim in core), "core time",
            "refused here, in one line"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for version, imported, outcomes, seconds, *rest in rows:
        cells = [version, imported]
        cells += [cell(outcomes[f]) if outcomes is not None else "-" for f, _ in core]
        cells.append(f"{seconds / 60:.1f} min" if seconds is not None else "-")
        cells.append(rest[0] if rest else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine() -> str:
    return (f"{os.cpu_count()}-core {platform.machine()} CPU, no GPU, Python "
            f"{platform.python_version()}")


def write_page(text: str, page: Path = PAGE) -> None:
    """Put ``text`` between the page's table markers."""
    doc = page.read_text()
    start, stop = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    page.write_text(doc[:start] + "\n" + text + "\n" + doc[stop:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("venvs", nargs="*", type=Path, help="virtual environments, one torch each")
    parser.add_argument("--matrix", type=Path, metavar="DIR",
                        help="also run every minor release of the supported range, one venv "
                        "each under DIR/<version> (installed when absent, reused when present)")
    parser.add_argument("--versions", nargs="*", help="with --matrix: these torch versions "
                        "instead of the newest patch of each minor release from the floor")
    parser.add_argument("--imports", action="store_true", help="only check `import zoo`")
    parser.add_argument("--save", type=Path, help="append each environment's results (JSON lines)")
    parser.add_argument("--load", type=Path, nargs="*", default=[],
                        help="results saved by --save, as rows of the table before the venvs'")
    parser.add_argument("--write", action="store_true", help=f"write the table into {PAGE.name}")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments")
    args = parser.parse_args(argv)
    core = core_files()
    rows = [tuple(json.loads(line)) for path in args.load
            for line in path.read_text().splitlines() if line.strip()]
    venvs = list(args.venvs)
    if args.matrix:
        for version in args.versions or releases(floor()):
            if make_venv(args.matrix / version, version):
                venvs.append(args.matrix / version)
    for venv in venvs:
        version, imported = torch_version(venv), import_zoo(venv)
        outcomes = seconds = None
        if not args.imports and imported == "yes":
            outcomes, seconds = run_core(venv, [f for f, _ in core], shlex.split(args.pytest_args))
            print(f"torch {version}: core in {seconds / 60:.1f} min", file=sys.stderr, flush=True)
        rows.append((version, imported, outcomes, seconds,
                     refused(venv) if imported == "yes" else "-"))
        if args.save:
            with args.save.open("a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
    rows.sort(key=lambda r: _release(r[0]))
    command = "python scripts/torch_versions.py " + " ".join(
        f'"{a}"' if " " in a else a for a in (argv or sys.argv[1:]))
    text = f"Measured on: {machine()}. Command: `{command}`\n\n" + table(rows, core)
    print(text)
    if args.write:
        write_page(text)
    failed = any(o is not None and any(x == "failed" for v in o.values() for x in v)
                 for _, _, o, _, *_ in rows)
    return 1 if failed or any(r[1] != "yes" for r in rows) else 0


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])


if __name__ == "__main__":
    sys.exit(main())
