"""kvrail's NIXL compat package (``python -m kvrail.nixl_compat``): the NIXL-API program,
importing ``nixl._api`` by name, runs unchanged on it; it says at import that it is kvrail;
it refuses to install over, next to, or import beside a real NIXL, and says what to do."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = dict(os.environ, KVRAIL_AGENT_CONFIG='{"backend": "tcp", "listen": "127.0.0.1:0"}')


def compat(*args, pythonpath=None):
    env = dict(ENV)
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-m", "kvrail.nixl_compat", *args], env=env,
                          capture_output=True, text=True, timeout=60)


def py(code, pythonpath):
    return subprocess.run([sys.executable, "-c", code], env=dict(ENV, PYTHONPATH=pythonpath),
                          capture_output=True, text=True, timeout=120)


def fake_nixl(root, package=True):
    """What a NIXL install leaves in site-packages: its distribution's metadata and (unless
    ``package`` is False) its ``nixl`` package."""
    info = root / "nixl_cu13-1.5.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nixl-cu13\nVersion: 1.5.1\n")
    if package:
        (root / "nixl").mkdir()
        (root / "nixl" / "__init__.py").write_text("REAL = True\n")
    return root


def test_the_nixl_api_program_runs_on_the_compat_package(tmp_path):
    r = compat("install", "--target", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "nixl" / "_api.py").is_file() and (tmp_path / "nixl" / "KVRAIL_NIXL_COMPAT").is_file()
    assert "kvrail" in compat("status", "--target", str(tmp_path)).stdout
    # NIXL's module names, each kvrail's
    r = py(
        "import nixl, nixl._api as a, nixl._bindings as b, nixl._utils as u, nixl.logging as l\n"
        "from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t\n"
        "import kvrail.nixl, kvrail._nixl_bindings\n"
        "assert a.nixl_agent is kvrail.nixl.nixl_agent and nixl.nixl_agent is a.nixl_agent\n"
        "assert b.nixlXferTelemetry is kvrail._nixl_bindings.nixlXferTelemetry\n"
        "assert b.nixlRegDList(b.DRAM_SEG).descCount() == 0 and b.nixlNoTelemetryError\n"
        "x = u.malloc_passthru(64); u.ba_buf(x, 64); u.free_passthru(x)\n"
        "print('ok', l.get_logger('nixl').name)\n",
        str(tmp_path),
    )
    assert r.returncode == 0, r.stderr
    assert "ok nixl" in r.stdout
    assert "kvrail" in r.stderr and "NIXL compat package" in r.stderr and "not NIXL" in r.stderr, r.stderr
    # the program NIXL users run, importing nixl._api by name: every check passes
    r = subprocess.run([sys.executable, os.path.join(HERE, "nixl_api_program.py"), "--impl", "nixl"],
                       env=dict(ENV, PYTHONPATH=str(tmp_path)), capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "[target] 20 ok, 0 failed" in out and "[initiator] 27 ok, 0 failed" in out, out
    # and it goes again
    r = compat("uninstall", "--target", str(tmp_path))
    assert r.returncode == 0 and not (tmp_path / "nixl").exists()
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".dist-info")]
    assert "no nixl package" in compat("status", "--target", str(tmp_path)).stdout


def test_it_does_not_write_over_a_real_nixl(tmp_path):
    site = fake_nixl(tmp_path / "site")
    r = compat("install", "--target", str(site))
    assert r.returncode == 1
    assert "is NIXL's (nixl-cu13 1.5.1" in r.stderr and "does not write over it" in r.stderr, r.stderr
    assert (site / "nixl" / "__init__.py").read_text() == "REAL = True\n"
    # uninstall leaves a nixl that is not kvrail's alone
    assert compat("uninstall", "--target", str(site)).returncode == 0
    assert (site / "nixl" / "__init__.py").is_file()
    assert "NIXL (nixl-cu13 1.5.1" in compat("status", "--target", str(site)).stdout


def test_it_does_not_install_where_a_real_nixl_is_on_the_path(tmp_path):
    real = fake_nixl(tmp_path / "real", package=False)
    r = compat("install", "--target", str(tmp_path / "ours"), pythonpath=str(real))
    assert r.returncode == 1
    assert "NIXL is installed where this Python finds it: nixl-cu13 1.5.1" in r.stderr, r.stderr
    assert "pip uninstall nixl-cu13" in r.stderr
    assert not (tmp_path / "ours" / "nixl").exists()


def test_it_does_not_import_beside_a_real_nixl(tmp_path):
    ours = tmp_path / "ours"
    assert compat("install", "--target", str(ours)).returncode == 0
    real = fake_nixl(tmp_path / "real", package=False)  # NIXL installed later, elsewhere
    r = py("import nixl", f"{ours}{os.pathsep}{real}")
    assert r.returncode != 0
    assert "ImportError" in r.stderr and "NIXL itself is installed too: nixl-cu13 1.5.1" in r.stderr, r.stderr
    assert "python -m kvrail.nixl_compat uninstall" in r.stderr
