"""configs/h200/session.sh's queue, the part of a device session that decides what runs on the GPU and
when, with a stand-in `python3` on PATH (it records its calls; its "pytest" passes or fails on demand):
- `queue cuda JOB...` runs the CUDA tests at once (beside the build), then waits for this machine's build by
  its pid (not for any process that merely names one), then runs each run in order, never beside the tests;
- a failed CUDA test run (here a crash with no summary line) stops the queue before any run (no
  figure on code the GPU found wrong), and `cuda` anywhere but first is refused."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "configs" / "h200" / "session.sh"

STAND_IN = """#!/bin/bash
echo "$(date +%s.%N) start $*" >> "$CALLS"
case "$*" in
  *pytest*) sleep 1
    if [ -n "$FAIL_TESTS" ]; then echo "Fatal Python error: Segmentation fault"; exit 139; fi
    echo "61 passed in 1.0s" ;;
  *"benchsuite run"*) echo "$PWD $*" >> "$CALLS.cwd"; sleep 0.5; echo "run done" ;;
esac
echo "$(date +%s.%N) end $*" >> "$CALLS"
"""

# the card the session script asks nvidia-smi for (RUN_PREFIX's default): none unless a test sets FAKE_GPU
GPU_STAND_IN = """#!/bin/bash
[ -n "$FAKE_GPU" ] || exit 9
echo "$FAKE_GPU"
"""


def _queue(
    tmp_path: Path,
    fail: bool,
    build_s: float = 0.0,
    more_env: dict[str, str] | None = None,
    copy_setup: Callable[[Path], None] | None = None,
    jobs: tuple[str, ...] = ("paged16", "ttft"),
) -> tuple[list[str], str]:
    """Queues `cuda` and `jobs` (`paged16 ttft`); with build_s, a stand-in build job still running that long (its pid in
    jobs/build.pid, as `detach` writes it)."""
    if shutil.which("ps") is None or shutil.which("setsid") is None:
        pytest.skip("needs ps and setsid (procps, util-linux)")
    bin_dir, copy, jobs_dir = tmp_path / "bin", tmp_path / "copy", tmp_path / "jobs"
    for d in (bin_dir, copy, jobs_dir):
        d.mkdir()
    if copy_setup is not None:
        copy_setup(copy)
    stand_in = bin_dir / "python3"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(stand_in.stat().st_mode | stat.S_IEXEC)
    gpu = bin_dir / "nvidia-smi"  # this machine's own card, if any, names no run here
    gpu.write_text(GPU_STAND_IN)
    gpu.chmod(gpu.stat().st_mode | stat.S_IEXEC)
    calls = tmp_path / "calls.log"
    if build_s:
        build = subprocess.Popen(["sleep", str(build_s)])  # noqa: S603, S607 - a stand-in job
        threading.Thread(target=build.wait, daemon=True).start()  # reaped when it ends, as init would
        (jobs_dir / "build.pid").write_text(f"{build.pid}\n")
        (tmp_path / "build_end").write_text(str(time.time() + build_s))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "SESSION_COPY": str(copy), "SESSION_JOBS": str(jobs_dir), "CALLS": str(calls),
           "SESSION_BASE": str(tmp_path / "base"),
           "FAIL_TESTS": "1" if fail else "", "FAKE_GPU": "", "RUN_PREFIX": "", **(more_env or {})}  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(["bash", str(SCRIPT), "queue", "cuda", *jobs], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    name = "-".join(("cuda", *jobs))
    assert done.returncode == 0 and f"started {name}" in done.stdout, done.stdout + done.stderr
    assert time.monotonic() - started < 1.0  # detached: the call does not wait for its jobs (~2 s here)
    log = jobs_dir / f"{name}.log"  # the detached queue's; its last line is "exit N" once it ended

    def ended() -> bool:  # the wrapper's own last line, not a step's "<job> exit N"
        lines = log.read_text().splitlines() if log.exists() else []
        return bool(lines) and re.fullmatch(r"exit \d+", lines[-1]) is not None

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not ended():
        time.sleep(0.2)
    assert ended(), log.read_text() if log.exists() else "no queue log"
    text = log.read_text()
    return calls.read_text().splitlines(), text


def test_the_queue_runs_the_cuda_tests_first_then_each_run_alone(tmp_path: Path) -> None:
    """The tests at once, beside the build; the runs after this machine's build job (by its pid), and not after an
    unrelated process whose command line merely names `benchsuite install` (the queue once waited on any such
    process)."""
    unrelated = subprocess.Popen(["bash", "-c", "sleep 120 # benchsuite install llama-server"])  # noqa: S603, S607
    try:
        calls, log = _queue(tmp_path, fail=False, build_s=3.0)
    finally:
        unrelated.kill()
    build_end = float((tmp_path / "build_end").read_text())
    tests_start, run_start = float(calls[0].split()[0]), float(calls[2].split()[0])
    assert tests_start < build_end - 1.0, "the CUDA tests waited for the build (they need none of it)"
    assert run_start >= build_end - 0.5, "a run started before the build ended"
    what = [" ".join(line.split()[1:]) for line in calls]
    assert what == [
        "start -m pytest tests/cuda -m cuda -q -p no:cacheprovider -o addopts=",
        "end -m pytest tests/cuda -m cuda -q -p no:cacheprovider -o addopts=",
        "start -m benchsuite run configs/h200/paged16.yaml --run-id h200-paged16 --no-report",
        "end -m benchsuite run configs/h200/paged16.yaml --run-id h200-paged16 --no-report",
        "start -m benchsuite run configs/h200/ttft.yaml --run-id h200-ttft --no-report",
        "end -m benchsuite run configs/h200/ttft.yaml --run-id h200-ttft --no-report",
    ], calls  # one after another: nothing starts before the previous call ended
    assert "cuda exit 0" in log and "paged16 exit 0" in log and "ttft exit 0" in log


def test_the_queue_takes_its_test_files_and_a_run_id_suffix_from_the_environment(tmp_path: Path) -> None:
    """CUDA_TESTS narrows the tests (a session with time for one matrix); RUN_SUFFIX runs a committed matrix
    again under a new run id (h200-paged16-b), so its results do not take the committed run's name."""
    more = {"CUDA_TESTS": "tests/cuda/test_fp8_cuda.py", "RUN_SUFFIX": "-b"}
    calls, _ = _queue(tmp_path, fail=False, more_env=more)
    what = [" ".join(line.split()[1:]) for line in calls if " start " in f" {line} "]
    assert what == [
        "start -m pytest tests/cuda/test_fp8_cuda.py -m cuda -q -p no:cacheprovider -o addopts=",
        "start -m benchsuite run configs/h200/paged16.yaml --run-id h200-paged16-b --no-report",
        "start -m benchsuite run configs/h200/ttft.yaml --run-id h200-ttft-b --no-report",
    ], calls


def test_the_run_ids_name_the_card_that_measured_them(tmp_path: Path) -> None:
    """RUN_PREFIX defaults to the card nvidia-smi names (h100 on an H100, h200 on an H200 or where nvidia-smi says
    nothing, another card's model otherwise), so a run on a card other than the one asked for does not take the
    H200's name; set, it is used as given."""
    for name in ("h100", "h200", "a100", "set"):
        (tmp_path / name).mkdir()
    calls, _ = _queue(tmp_path / "h100", fail=False, more_env={"FAKE_GPU": "NVIDIA H100 80GB HBM3"})
    runs = [line.split("--run-id ")[1].split()[0] for line in calls if " start " in f" {line} " and "--run-id" in line]
    assert runs == ["h100-paged16", "h100-ttft"], calls
    calls, _ = _queue(tmp_path / "h200", fail=False, more_env={"FAKE_GPU": "NVIDIA H200"})
    runs = [line.split("--run-id ")[1].split()[0] for line in calls if " start " in f" {line} " and "--run-id" in line]
    assert runs == ["h200-paged16", "h200-ttft"], calls
    calls, _ = _queue(tmp_path / "a100", fail=False, more_env={"FAKE_GPU": "NVIDIA A100-SXM4-80GB"})
    runs = [line.split("--run-id ")[1].split()[0] for line in calls if " start " in f" {line} " and "--run-id" in line]
    assert runs == ["a100-paged16", "a100-ttft"], calls  # another card: its own name, not the H200's
    more = {"FAKE_GPU": "NVIDIA H100 80GB HBM3", "RUN_PREFIX": "lab", "RUN_SUFFIX": "-b"}
    calls, _ = _queue(tmp_path / "set", fail=False, more_env=more)
    runs = [line.split("--run-id ")[1].split()[0] for line in calls if " start " in f" {line} " and "--run-id" in line]
    assert runs == ["lab-paged16-b", "lab-ttft-b"], calls


def _git_copy(copy: Path) -> None:
    """The copy as prepare leaves it: a checkout with its .git (here one commit of one file)."""
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    (copy / "marker.txt").write_text("the base commit's tree\n")
    (copy / "results" / "h200-committed").mkdir(parents=True)  # a committed run: never a base run's result
    (copy / "results" / "h200-committed" / "manifest.json").write_text("{}\n")
    for argv in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "base"], ["tag", "base"]):
        subprocess.run(["git", *argv], cwd=copy, env=env, check=True, capture_output=True)


def test_a_base_commit_measures_each_run_again_by_its_own_code(tmp_path: Path) -> None:
    """BASE_COMMIT: after each run, the same run id with -base, run from that commit's unpacked tree (an A/B on
    whichever card came, both sides on it); the tree is unpacked once, so the second base run keeps the first's
    results; a commit the copy's .git lacks skips the base runs, said in the log, and the head runs still go."""
    if shutil.which("git") is None:
        pytest.skip("needs git")
    calls, log = _queue(tmp_path, fail=False, more_env={"BASE_COMMIT": "base", "RUN_SUFFIX": "-e"},
                        copy_setup=_git_copy)  # fmt: skip
    cwd = (tmp_path / "calls.log.cwd").read_text().splitlines()
    base = tmp_path / "base"
    runs = [(line.split()[0], line.split("--run-id ")[1].split()[0]) for line in cwd]
    assert runs == [
        (str(tmp_path / "copy"), "h200-paged16-e"), (str(base), "h200-paged16-e-base"),
        (str(tmp_path / "copy"), "h200-ttft-e"), (str(base), "h200-ttft-e-base"),
    ], cwd  # fmt: skip
    assert (base / "marker.txt").read_text() == "the base commit's tree\n" and (base / ".base_commit").is_file()
    assert not (base / "results" / "h200-committed").exists()  # collect would bring it back as this session's
    assert "paged16 base exit 0" in log and "ttft base exit 0" in log
    missing = tmp_path / "missing"
    missing.mkdir()
    calls, log = _queue(missing, fail=False, more_env={"BASE_COMMIT": "no-such-commit"}, copy_setup=_git_copy)
    ran = [line.split("--run-id ")[1].split()[0] for line in (missing / "calls.log.cwd").read_text().splitlines()]
    assert ran == ["h200-paged16", "h200-ttft"] and "ttft exit 0" in log, log
    assert re.search(r"^paged16 base exit [1-9]", log, re.M) and "not a valid object name" in log, log


def test_the_queue_runs_only_the_servers_named_in_run_only(tmp_path: Path) -> None:
    """RUN_ONLY: a session with device time for part of a matrix measures those servers; the run id is the
    matrix's, so a later run without it measures the rest."""
    more = {"RUN_ONLY": "paged-fp8 paged-fp8-synthetic", "RUN_SUFFIX": "-c"}
    calls, _ = _queue(tmp_path, fail=False, more_env=more)
    runs = [" ".join(line.split()[1:]) for line in calls if " start " in f" {line} " and "benchsuite run" in line]
    only = "--only paged-fp8 --only paged-fp8-synthetic"
    assert runs == [
        f"start -m benchsuite run configs/h200/paged16.yaml --run-id h200-paged16-c {only} --no-report",
        f"start -m benchsuite run configs/h200/ttft.yaml --run-id h200-ttft-c {only} --no-report",
    ], calls


def test_a_job_of_its_own_run_only_measures_its_servers_beside_the_others(tmp_path: Path) -> None:
    """RUN_ONLY_<job> replaces RUN_ONLY for that job, and an empty one measures its whole matrix: one queue runs a
    whole A/B matrix and part of another."""
    more = {"RUN_ONLY": "paged-fp8", "RUN_ONLY_paged16": "", "RUN_ONLY_ttft": "a b"}
    calls, _ = _queue(tmp_path, fail=False, more_env=more)
    runs = [" ".join(line.split()[1:]) for line in calls if " start " in f" {line} " and "benchsuite run" in line]
    assert runs == [
        "start -m benchsuite run configs/h200/paged16.yaml --run-id h200-paged16 --no-report",
        "start -m benchsuite run configs/h200/ttft.yaml --run-id h200-ttft --only a --only b --no-report",
    ], calls


def test_cuda_goes_first_in_a_queue(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "SESSION_COPY": str(tmp_path), "SESSION_JOBS": str(tmp_path)}
    done = subprocess.run(["bash", str(SCRIPT), "queue", "paged16", "cuda"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 2 and "cuda goes first" in done.stderr, done.stdout + done.stderr
    assert not list(tmp_path.glob("*.log"))  # nothing started


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["queue", "cuda", "paged16", "nosuch"], "no nosuch.yaml"),  # a typo refused before anything runs
        (["queue", "../h200/paged16"], "no ../h200/paged16.yaml"),  # a job is a plain name: no path leaves configs/h200
        (["queue", "cuda", "foo-bar"], "no foo-bar.yaml"),  # no `-`: RUN_ONLY_<name> must be a variable's name
        (["queue", "cuda"], "cuda alone"),  # the queue's job would be `cuda` and wait for its own pid
        (["nosuch"], "usage:"),
        (["policyconfirm.yaml"], "usage:"),
        (["../h200/paged16"], "usage:"),
    ],
)
def test_a_job_that_names_no_matrix_is_refused_before_anything_runs(tmp_path: Path, args: list[str], said: str) -> None:
    """A matrix job is any configs/h200/MATRIX.yaml by its plain name (one place decides: a new matrix needs no edit
    of the script); anything else is a usage error, exit 2, and nothing starts."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "SESSION_COPY": str(tmp_path), "SESSION_JOBS": str(tmp_path),
           "RUN_PREFIX": "h200"}  # fmt: skip
    done = subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 2 and said in done.stderr, done.stdout + done.stderr
    assert not list(tmp_path.glob("*.log")) and not list(tmp_path.glob("*.pid"))  # nothing started


def test_every_committed_matrix_is_a_job(tmp_path: Path) -> None:
    """Each configs/h200/*.yaml runs by its name, alone and in a queue: duelconfirm among them, which no list in the
    script names."""
    names = sorted(p.stem for p in SCRIPT.parent.glob("*.yaml"))
    assert "duelconfirm" in names and "duel" in names
    # a matrix named as one of the script's own commands could never run: those come first
    assert not set(names) & {"prepare", "cuda", "flags", "policies", "queue", "poll", "routing"}
    define = f'HERE={SCRIPT.parent}; eval "$(grep "^is_matrix()" {SCRIPT})"'
    probe = f"{define}; for n in {' '.join(names)}; do is_matrix $n || echo $n; done"
    done = subprocess.run(["bash", "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and done.stdout == "", done.stdout + done.stderr
    calls, log = _queue(tmp_path, fail=False, jobs=("duelconfirm",))
    what = [" ".join(line.split()[1:]) for line in calls if " start " in f" {line} "]
    assert what[1:] == ["start -m benchsuite run configs/h200/duelconfirm.yaml --run-id h200-duelconfirm --no-report"]
    assert "duelconfirm exit 0" in log


def test_flags_and_policies_are_the_scripts_own_jobs_not_matrices(tmp_path: Path) -> None:
    """`flags` and `policies` in a queue run their own commands (here: no llama-server built, no routing trace, so
    each says so and fails), in order after the tests, not a matrix's `benchsuite run`."""
    calls, log = _queue(tmp_path, fail=False, jobs=("flags", "policies"))
    assert "benchsuite run" not in "".join(calls)
    assert log.index("flags: no llama-server built") < log.index("flags exit 1") < log.index("policies exit 1")
    assert "policies: no routing trace" in log


def test_a_failed_cuda_test_stops_the_queue_before_any_run(tmp_path: Path) -> None:
    calls, log = _queue(tmp_path, fail=True)
    assert len(calls) == 1 and "start" in calls[0] and "pytest" in calls[0]  # it crashed: no "end"
    assert "the CUDA tests failed (cuda.log): nothing run" in log
    assert "benchsuite run" not in "".join(calls)


def test_prepare_restores_a_carried_run_so_the_queue_resumes_it(tmp_path: Path) -> None:
    """A machine taken back mid-run: the run's last tar, carried under .carry/results/, is put back into the
    copy's results/ (which prepare otherwise empties), so `queue` resumes it instead of starting again."""
    if shutil.which("setsid") is None:
        pytest.skip("needs setsid (util-linux)")
    tree, copy, jobs, bin_dir = (tmp_path / d for d in ("tree", "copy", "jobs", "bin"))
    for d in (tree / ".carry" / "results", tree / "results" / "h200-old", bin_dir):
        d.mkdir(parents=True)
    run = tmp_path / "h200-staging-c" / "cells"
    run.mkdir(parents=True)
    (run / "a.json").write_text("{}")
    subprocess.run(["tar", "-C", str(tmp_path), "-czf", str(tree / ".carry" / "results" / "h200-staging-c.tar.gz"),
                    "h200-staging-c"], check=True)  # fmt: skip
    for tool in ("python3", "nvidia-smi"):  # stand-ins: the models job and the GPU query
        stand_in = bin_dir / tool
        stand_in.write_text("#!/bin/bash\necho stand-in $*\n")
        stand_in.chmod(stand_in.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "SESSION_COPY": str(copy), "SESSION_JOBS": str(jobs)}  # fmt: skip
    done = subprocess.run(["bash", str(SCRIPT), "prepare", "builtin"], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0 and "restored h200-staging-c" in done.stdout, done.stdout + done.stderr
    assert (copy / "results" / "h200-staging-c" / "cells" / "a.json").is_file()
    assert not (copy / "results" / "h200-old").exists()  # the committed runs stay out of the copy


def test_a_call_brings_the_runs_back_and_their_routing_traces(tmp_path: Path) -> None:
    """A poll once the jobs have ended: each run's tar without its traces, and every run's traces in routing.tar
    without their routing weights (`benchsuite trace ids-only`: the replays read ids only, so the policy replay can
    run off the device); once per set of traces, never beside a running job, never in the place of a log or a run
    among the call's 8 files (`session.sh routing` then brings them in a call of their own); over a file's limit
    (16 MB) in parts, routing.tar.part-NN, when the call has the files and bytes (60 MB) for them all, as for the
    one file; over what any call brings back they stay."""
    from paged_experts.routing.trace import read_trace, save_trace, synthesize_trace

    copy, jobs, out = tmp_path / "copy", tmp_path / "jobs", tmp_path / "out"
    traces = {}
    for seed, run in enumerate(("h200-policy-b", "h200-window")):
        (copy / "results" / run / "routing").mkdir(parents=True)
        (copy / "results" / run / "cells.parquet").write_text("cells")
        traces[run] = synthesize_trace("qwen3-30b-a3b", 4, 128, 8, requests=2, tokens_per_request=32, seed=seed)
        save_trace(traces[run], copy / "results" / run / "routing" / "abc.trace")
    jobs.mkdir()
    # as on the device: the copy holds the packages, and `python3` is this interpreter
    for package in ("benchsuite", "paged_experts"):
        (copy / package).symlink_to(ROOT / package)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    busy = f"stand-in-run-{os.getpid()}-{tmp_path.name}"  # a run of this test's own, not any on this machine
    # a file's and a call's limits in MB, not 16 and 60 (what the device brings back): the parts below stay small
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out), "SESSION_COPY": str(copy),
           "SESSION_JOBS": str(jobs), "SESSION_BUSY": busy, "SESSION_PART_BYTES": "1000000",
           "SESSION_CALL_BYTES": "3000000"}  # fmt: skip

    def call(*verb: str, logs: int = 0, log_bytes: int = 3) -> str:
        """One device call: its $OUT starts empty; `logs` stand-in files of `log_bytes` already in it."""
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        for i in range(logs):
            (out / f"job{i}.log").write_bytes(b"x" * log_bytes)
        done = subprocess.run(["bash", str(SCRIPT), *verb], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120, check=False)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    # nothing running: the poll ends at once with its minute left, and packs; 7 files and routing.tar make 8
    assert "routing traces: 2 in routing.tar (all without their weights)" in call("poll", "61", logs=5)
    back = tmp_path / "back"
    back.mkdir()
    subprocess.run(["tar", "-C", str(back), "-xf", str(out / "routing.tar")], check=True)  # noqa: S603, S607
    for run, trace in traces.items():
        got = read_trace(back / run / "routing" / "abc.trace")
        assert got.weights is None and (got.ids == trace.ids).all() and got.steps == trace.steps
    run_tar = subprocess.run(["tar", "-tzf", str(out / "h200-window.tar.gz")], capture_output=True, text=True,
                             check=True).stdout.split()  # fmt: skip
    assert "h200-window/cells.parquet" in run_tar and not any("routing" in name for name in run_tar)
    assert "routing traces" not in call("poll", "61") and not (out / "routing.tar").exists()  # the same set: done
    assert "routing traces: 2 in routing.tar" in call("routing")  # forced, in a call of its own
    assert "routing traces" not in call("poll", "59") and not (out / "routing.tar").exists()  # under a minute left
    # a new trace beside a running job: not packed (the copies would take a core beside it), even when forced
    save_trace(traces["h200-window"], copy / "results" / "h200-window" / "routing" / "new.trace")
    job = subprocess.Popen(["bash", "-c", f'exec -a "{busy}" sleep 60'])  # noqa: S603, S607
    try:
        assert "a job is running" in call("routing") and not (out / "routing.tar").exists()
    finally:
        job.kill()
        job.wait()
    # 8 files taken (2 runs' tars, 6 logs): left there, and `routing` brings them alone
    assert "the call's 8 files are taken" in call("poll", "61", logs=6) and not (out / "routing.tar").exists()
    assert "routing traces: 3 in routing.tar" in call("routing")
    # one file, but over the call's bytes (3 MB here, 60 MB on the device): 3 MB of logs already in it
    save_trace(traces["h200-policy-b"], copy / "results" / "h200-policy-b" / "routing" / "new.trace")
    said = call("poll", "61", logs=2, log_bytes=1_500_000)
    assert (
        "routing traces: 4, 1 MB in one file (all without their weights), left on the machine (this call has 4 free"
        " files and 0 MB: `session.sh routing` brings them in a call of its own)" in said
    )
    assert not list(out.glob("routing.tar*"))
    assert "routing traces: 4 in routing.tar" in call("routing")
    # a file that is no trace goes as it is (routing-ids.txt says why); over a file's limit the tar comes back in
    # parts, when the call has the files and bytes for all of them: here 5 logs and 2 runs' tars leave 1 file
    big = copy / "results" / "h200-window" / "routing" / "big.trace"
    big.write_bytes(os.urandom(1_500_000))
    said = call("poll", "61", logs=5)
    assert (
        "routing traces: 5, 2 MB in 2 parts (1 of them with their weights: routing-ids.txt says why), left on"
        " the machine (this call has 1 free files and 2 MB: `session.sh routing` brings them" in said
    )
    assert not list(out.glob("routing.tar*")) and "cannot read trace" in (jobs / "routing-ids.txt").read_text()
    assert "routing traces" not in call("poll", "61")  # that set is decided: not copied again every poll
    said = call("routing")
    assert "routing traces: 5 in 2 parts, routing.tar.part-00..01 (1 of them with their weights" in said

    def unpacked() -> Path:
        """The parts this call brought, put together (`cat routing.tar.part-* > routing.tar`) and unpacked."""
        parts = sorted(out.glob("routing.tar.part-*"))
        assert [p.name for p in parts] == [f"routing.tar.part-{i:02d}" for i in range(len(parts))]
        assert all(p.stat().st_size <= 1_000_000 for p in parts)
        whole = tmp_path / "whole.tar"
        whole.write_bytes(b"".join(p.read_bytes() for p in parts))
        shutil.rmtree(back)
        back.mkdir()
        subprocess.run(["tar", "-C", str(back), "-xf", str(whole)], check=True)  # noqa: S603, S607
        return back

    assert (unpacked() / "h200-window" / "routing" / "big.trace").read_bytes() == big.read_bytes()
    got = read_trace(back / "h200-window" / "routing" / "new.trace")
    assert got.weights is None and (got.ids == traces["h200-window"].ids).all()
    # a new set in parts, in a poll this time (room for both parts among its files and bytes)
    save_trace(traces["h200-window"], copy / "results" / "h200-window" / "routing" / "newer.trace")
    said = call("poll", "61", logs=2)
    assert "routing traces: 6 in 2 parts, routing.tar.part-00..01" in said
    assert (unpacked() / "h200-window" / "routing" / "newer.trace").exists()
    # over what any call brings back (3 MB here, 60 MB on the device): left there, even in a call of its own
    (copy / "results" / "h200-policy-b" / "routing" / "big.trace").write_bytes(os.urandom(2_000_000))
    said = call("routing")
    assert "routing traces: 7, 4 MB in 4 parts" in said and "left on the machine (this call has 8 free files" in said
    assert "session.sh routing" not in said and not list(out.glob("routing.tar*"))
