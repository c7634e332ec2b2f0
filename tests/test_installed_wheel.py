"""The wheel installs one import name, `dataflow`: built and installed (not editable) into a fresh
virtual environment, it trains two tiny steps from a trainer's directory that has its own
packages named models, kernels, bench, ring and memplan (the names our folders carry in the
repository), and the trainer's packages stay its own."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
THEIRS = ("models", "kernels", "bench", "ring", "memplan")

TRAINER = textwrap.dedent("""
    import sys
    import numpy as np
    import models, kernels, bench, ring, memplan          # the trainer's own packages
    from models.config import THEIRS
    import dataflow
    from dataflow import Engine, ConfigError
    assert THEIRS == "the trainer's", THEIRS
    assert all(m.__file__.startswith(sys.argv[1]) for m in (models, kernels, bench, ring, memplan))
    assert "site-packages" in dataflow.__file__, dataflow.__file__
    import dataflow.memplan, dataflow.models.config
    assert "site-packages" in dataflow.memplan.__file__, dataflow.memplan.__file__
    eng = Engine("tiny", host_gb=1, dev_gb=0.25, seqlen=64, backend="numpy", seed=0)
    rng = np.random.default_rng(0)
    for _ in range(2):
        r = eng.train_step(rng.integers(0, 256, (eng.seqs_per_step, 65)))
        assert np.isfinite(r.loss), r.loss
    try:
        Engine("no-such-model", host_gb=1, dev_gb=0.25, seqlen=64, backend="numpy")
    except ConfigError:
        pass
    print("ok", r.step)
""")


def _wheel(tmp: Path) -> Path:
    # From a copy of the sources: an in-tree build would leave build/ in the checkout, whose
    # stale modules a later wheel would carry.
    src = tmp / "src"
    for name in ("pyproject.toml", "setup.py", "README.md"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    for folder in ("dataflow", *THEIRS):
        shutil.copytree(ROOT / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "records"))
    out = tmp / "wheel"
    # build isolation, as `pip install .` builds (setuptools from pyproject's build-system)
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                          "-w", str(out), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    (wheel,) = out.glob("dataflow-*.whl")
    return wheel


def test_the_wheel_installs_only_the_dataflow_import_name(tmp_path):
    wheel = _wheel(tmp_path)
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"dataflow"}, tops
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in ("dataflow/cli/plan.py", "dataflow/models/zoo/tiny.json",
                     "dataflow/kernels/reference/__init__.py", "dataflow/cli/ring.py",
                     "dataflow/cli/demo.py", "dataflow/cli/sweep.py"):
        assert expected in names, expected

    # A fresh venv; the test environment's third-party packages (numpy, ...) reach it through a
    # .pth line, which does not run that environment's own .pth files (our editable install).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                          "--target", str(site), str(wheel)], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr

    trainer = tmp_path / "trainer"
    for name in THEIRS:
        (trainer / name).mkdir(parents=True)
        (trainer / name / "__init__.py").write_text("")
    (trainer / "models" / "config.py").write_text('THEIRS = "the trainer\'s"\n')
    (trainer / "train.py").write_text(TRAINER)
    res = subprocess.run([str(py), "train.py", str(trainer)], cwd=trainer, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip().endswith("ok 2"), res.stdout
