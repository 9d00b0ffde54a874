"""The scripts in examples/ run as their docstrings say (in a subprocess: they set JAX's global config)."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_forms_agree_prints_every_rule_and_passes():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "forms_agree.py"), "--T", "9", "--batch", "1",
                          "--heads", "1", "--dk", "4", "--dv", "3", "--chunk-size", "4", "--window", "3"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line.split("|") for line in out.stdout.splitlines() if line.strip().startswith("Falcon-")]
    assert [r[0].strip() for r in rows] == [f"Falcon-{v}" for v in ("1", "2", "3", "1A", "2A", "3A")]
    assert all(float(r[1]) < 1e-10 and float(r[2]) < 1e-10 for r in rows)
    assert out.stdout.rstrip().endswith("OK")
