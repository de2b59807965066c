"""The set-up decision (tests/_setup.py): GPU or not, PyTorch's CPU index reachable or
not, uv there or not, the knobs. Every probe is mocked: no network, no installs."""
import time
import urllib.error

import pytest

import _setup
from _setup import CPU_INDEX, TORCH_PIN, commands, decide

UV = "/usr/bin/uv"
DEPS = ["torch>=2.5", "triton>=3.2"]


class Calls:
    """A probe or uv lookup that answers `result` and counts its calls."""

    def __init__(self, result):
        self.result, self.calls = result, []

    def __call__(self, *args):
        self.calls.append(args)
        return self.result


def plan(*, gpu=False, index_answers=False, uv=UV, torch_spec="", torch_index="", installer=""):
    probe, find_uv = Calls(index_answers), Calls(uv)
    result = decide(gpu=gpu, torch_spec=torch_spec, torch_index=torch_index, installer=installer,
                    probe=probe, find_uv=find_uv)
    return result, probe.calls, find_uv.calls


# --- decide ---------------------------------------------------------------------------

def test_gpu_keeps_the_old_path_system_torch_and_pip_without_probing():
    p, probed, looked_for_uv = plan(gpu=True, index_answers=True)
    assert (p.path, p.torch, p.index, p.installer, p.system_site_packages) == ("gpu", "torch", None, "pip", True)
    assert probed == [] and looked_for_uv == []


def test_gpu_honours_the_torch_knob():
    assert plan(gpu=True, torch_spec="torch==2.11.0")[0].torch == "torch==2.11.0"


def test_no_gpu_and_the_cpu_index_answers_takes_torch_from_it():
    p, probed, _ = plan(index_answers=True)
    assert (p.path, p.torch, p.index, p.system_site_packages) == ("cpu-index", TORCH_PIN, CPU_INDEX, False)
    assert probed == [(CPU_INDEX,)]


def test_no_gpu_and_no_answer_falls_back_to_the_default_index():
    p, probed, _ = plan(index_answers=False)
    assert (p.path, p.torch, p.index) == ("fallback", TORCH_PIN, None)
    assert probed == [(CPU_INDEX,)]


def test_torch_index_url_is_used_without_probing():
    p, probed, _ = plan(torch_index="https://mirror.example/pytorch-wheels/cpu", index_answers=False)
    assert (p.path, p.index) == ("mirror", "https://mirror.example/pytorch-wheels/cpu")
    assert probed == []


def test_torch_index_default_skips_the_probe():
    p, probed, _ = plan(torch_index="default", index_answers=True)
    assert (p.path, p.index) == ("default", None)
    assert probed == []


def test_no_gpu_honours_the_torch_knob():
    assert plan(torch_spec="torch==2.12.0", index_answers=True)[0].torch == "torch==2.12.0"


@pytest.mark.parametrize("uv, installer", [(UV, "uv"), (None, "pip")])
def test_uv_when_it_can_be_had_else_pip(uv, installer):
    p, _, looked_for_uv = plan(uv=uv)
    assert (p.installer, p.uv) == (installer, uv)
    assert len(looked_for_uv) == 1


def test_installer_pip_does_not_look_for_uv():
    p, _, looked_for_uv = plan(installer="pip")
    assert p.installer == "pip" and looked_for_uv == []


def test_installer_uv_without_uv_says_so():
    with pytest.raises(SystemExit, match="INSTALLER=uv, but uv is not on PATH"):
        plan(installer="uv", uv=None)


# --- the one line make prints -------------------------------------------------------

def test_the_line_names_the_path_the_installer_and_the_size():
    assert "PyTorch's CPU index" in plan(index_answers=True)[0].line()
    assert "192 MB" in plan(index_answers=True)[0].line()
    fallback = plan(index_answers=False, uv=None)[0].line()
    assert "did not answer" in fallback and "falling back" in fallback and "with pip" in fallback
    assert "192 MB" in fallback and "2.5 GB" in fallback
    assert "reuses the system's torch" in plan(gpu=True)[0].line()


def test_the_line_quotes_no_size_for_a_torch_it_was_not_measured_for():
    line = plan(index_answers=True, torch_spec="torch==2.12.0")[0].line()
    assert "MB" not in line and "sizes" not in line


# --- the commands -------------------------------------------------------------------

def run(p, pip_options=(), compile_bytecode=True):
    return commands(p, ".venv", "python3", DEPS, list(pip_options), compile_bytecode)


def test_pip_commands_take_only_torch_from_the_chosen_index():
    venv, torch, deps = run(plan(index_answers=True, uv=None)[0])
    assert venv == ["python3", "-m", "venv", ".venv"]
    assert torch[-3:] == ["--index-url", CPU_INDEX, TORCH_PIN]
    assert "--index-url" not in deps and deps[-2:] == DEPS


def test_pip_fallback_names_no_index():
    _, torch, _ = run(plan(index_answers=False, uv=None)[0])
    assert "--index-url" not in torch and torch[-1] == TORCH_PIN


def test_gpu_commands_see_the_system_site_packages():
    venv, torch, _ = run(plan(gpu=True)[0])
    assert "--system-site-packages" in venv and torch[-1] == "torch"


PIP_OPTIONS = ["--find-links", "/opt/wheels"]


def test_uv_fallback_uses_the_sources_pip_is_configured_with():
    venv, torch, deps = run(plan(index_answers=False)[0], PIP_OPTIONS)
    assert venv[:2] == [UV, "venv"] and "--seed" in venv
    for step in (torch, deps):
        assert step[:3] == [UV, "pip", "install"] and "--compile-bytecode" in step
        assert "--find-links" in step and "unsafe-best-match" in step
    assert "--index-url" not in torch


def test_uv_compiles_bytecode_only_when_asked():
    assert all("--compile-bytecode" not in step for step in run(plan()[0], compile_bytecode=False))


def test_uv_cpu_index_takes_torch_from_it_alone():
    _, torch, deps = run(plan(index_answers=True)[0], PIP_OPTIONS)
    assert torch[-3:] == ["--index-url", CPU_INDEX, TORCH_PIN] and "--find-links" not in torch
    assert "--find-links" in deps and "--index-url" not in deps


# --- the probes, with the outside world mocked ------------------------------------------

class Response:
    def __init__(self, status):
        self.status = status

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("answer, expected", [
    (Response(200), True),
    (urllib.error.URLError("Name or service not known"), False),
    (urllib.error.HTTPError(CPU_INDEX, 404, "Not Found", {}, None), False),
    (TimeoutError("timed out"), False),
])
def test_index_answers(monkeypatch, answer, expected):
    urls = []

    def urlopen(url, timeout):
        urls.append(url)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(_setup.urllib.request, "urlopen", urlopen)
    assert _setup.index_answers(CPU_INDEX + "/") is expected
    assert urls == [CPU_INDEX + "/torch/"]


def test_index_answers_gives_up_on_a_hang_in_time(monkeypatch):
    """A name lookup that hangs is not bounded by urllib's timeout; the probe is. A late answer does not count."""
    monkeypatch.setattr(_setup.urllib.request, "urlopen", lambda url, timeout: time.sleep(2) or Response(200))
    start = time.monotonic()
    assert _setup.index_answers(CPU_INDEX, timeout=0.2) is False
    assert time.monotonic() - start < 1


def test_find_uv_prefers_the_one_on_path(monkeypatch, tmp_path):
    (tmp_path / "uv").touch()
    monkeypatch.setattr(_setup.shutil, "which", lambda name: str(tmp_path / "uv"))
    monkeypatch.setattr(_setup.subprocess, "run", lambda *a, **k: pytest.fail("bootstrapped uv"))
    assert _setup.find_uv(bootstrap=tmp_path / "boot") == str(tmp_path / "uv")


def test_find_uv_reuses_an_earlier_bootstrap(monkeypatch, tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/uv").touch()
    monkeypatch.setattr(_setup.shutil, "which", lambda name: None)
    monkeypatch.setattr(_setup.subprocess, "run", lambda *a, **k: pytest.fail("bootstrapped uv"))
    assert _setup.find_uv(bootstrap=tmp_path) == str(tmp_path / "bin/uv")


@pytest.mark.parametrize("pip_works", [True, False])
def test_find_uv_bootstraps_with_pip_or_gives_none(monkeypatch, tmp_path, pip_works):
    class Done:
        returncode = 0 if pip_works else 1

    def run(argv, **kwargs):
        assert argv[1:] == ["-m", "pip", "install", "--quiet", "--target", str(tmp_path), "uv"]
        if pip_works:
            (tmp_path / "bin").mkdir()
            (tmp_path / "bin/uv").touch()
        return Done()

    monkeypatch.setattr(_setup.shutil, "which", lambda name: None)
    monkeypatch.setattr(_setup.subprocess, "run", run)
    assert _setup.find_uv(python="python3", bootstrap=tmp_path) == (str(tmp_path / "bin/uv") if pip_works else None)


def test_pip_config_becomes_uv_options_once_each():
    listing = "\n".join([
        ":env:.find-links='/opt/wheels'",
        "global.constraint='/etc/pip/constraints.txt'",
        "global.cert='/etc/ssl/certs/ca-certificates.crt'",  # not an index setting
        "user.find-links='/opt/wheels'",                      # set in two places, passed once
        "user.extra-index-url='file:///a/simple file:///b/simple'",
        "site.index-url='https://mirror.example/simple'",
    ])
    assert _setup.uv_options_from_pip_config(listing) == [
        "--find-links", "/opt/wheels", "--constraint", "/etc/pip/constraints.txt",
        "--extra-index-url", "file:///a/simple", "--extra-index-url", "file:///b/simple",
        "--index-url", "https://mirror.example/simple"]
    assert _setup.uv_options_from_pip_config("") == []


def test_readme_quotes_the_sizes_setup_prints():
    readme = (_setup.ROOT / "README.md").read_text()
    assert "TORCH_INDEX" in readme
    for size in ("192 MB", "2.5 GB"):
        assert size in readme and size in str(_setup.SIZES), size


def test_an_unknown_installer_is_refused():
    with pytest.raises(SystemExit, match="use INSTALLER=uv or INSTALLER=pip"):
        plan(installer="conda")
