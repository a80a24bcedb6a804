"""A wheel install carries the shipped toy policy and the entry point of the default tools: Agent() finds both from
any directory, without the repository."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_a_wheel_install_finds_the_toy_policy_anywhere(tmp_path):
    # pip without PYTHONPATH: a checkout on it (a suite run with PYTHONPATH=.) reads as paravt already installed
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT),
                    "-w", str(tmp_path / "wheel")], check=True, capture_output=True, timeout=300, env=env)
    [wheel] = (tmp_path / "wheel").glob("paravt-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = subprocess.run([py, "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True,
                          text=True, check=True).stdout.strip()
    # the new venv sees this one's dependencies (torch, transformers ...) but not the repository
    deps = [p for p in sys.path if p.endswith("site-packages")]
    Path(site, "deps.pth").write_text("\n".join(deps) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True, timeout=300, env=env)
    code = textwrap.dedent("""
        import paravt_agent, sys
        from paravt_agent.defaults import default_model_dir
        assert "site-packages" in paravt_agent.__file__, paravt_agent.__file__   # the wheel, not the clone
        from paravt_agent.plugins import _source_entry_points, toolset
        from tools.registry import registry_of
        assert toolset() is registry_of and not _source_entry_points("paravt.toolsets")  # by the wheel's entry point
        print(default_model_dir())
    """)
    run = subprocess.run([py, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr
    found = Path(run.stdout.strip())
    assert found == venv / "share" / "paravt" / "toy" and (found / "model.safetensors").is_file()


def test_make_install_says_each_stage_and_the_size_of_torch():
    """`make install` prints a line before each stage (the environment, pip, torch, the package), and torch's line
    says it is the large one and how large, before its download starts (pip's own progress bar then shows)."""
    root = Path(__file__).resolve().parents[1]
    plan = subprocess.run(["make", "-n", "-B", "install"], cwd=root, capture_output=True, text=True, timeout=60).stdout
    stages = [line for line in plan.splitlines() if line.startswith('echo "[install')]
    assert [s.split("]")[0] for s in stages] == ['echo "[install 1/4', 'echo "[install 2/4', 'echo "[install 3/4',
                                                 'echo "[install 4/4', 'echo "[install']
    assert "the large one, about 2.7 GB to download" in stages[2]
    lines = plan.splitlines()
    torch_pip = next(i for i, line in enumerate(lines) if "pip install" in line and "torch==" in line)
    assert lines.index(stages[2]) < torch_pip and " -q " not in lines[torch_pip]  # pip shows its progress
