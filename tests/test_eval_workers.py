"""`eyas eval --workers N`, on a tiny random Llama: a worker that dies is one line naming the
prompts it lost, and no worker outlives the run; the workers die with a killed eval; more
workers than prompts are capped at one a prompt.

The worker tests run `eyas eval` from this file in script mode: its top-level hook is run
again by every spawned worker (which imports the parent's main file), so each worker
records its pid and, as the test asks through the environment, dies on a chosen prompt or
hangs once it answers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ME = Path(__file__).resolve()
SRC = str(ME.parents[1] / "src")
PROMPTS = [{"id": f"p{i}", "prompt": f"say something about the number {i}"} for i in range(4)]


def _hook() -> None:
    """In a worker: record its pid, then patch `run_prompt` to note the prompt it answers and,
    as EYAS_TEST_DIE_ON / EYAS_TEST_HANG ask, SIGKILL itself on that prompt or hang there."""
    import eyas.evaluate.run as run

    marks = Path(os.environ["EYAS_TEST_MARKS"])
    (marks / f"worker-{os.getpid()}").touch()
    real = run.run_prompt

    def run_prompt(target, tokenizer, proposer, prompt, *args, **kwargs):
        (marks / f"answering-{os.getpid()}").touch()
        if prompt.id == os.environ.get("EYAS_TEST_DIE_ON"):
            # Not before the other worker has started: on a loaded machine it may still be
            # importing, and the test must know every worker's pid to see that none lives on.
            deadline = time.monotonic() + 240
            while len(list(marks.glob("worker-*"))) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            os.kill(os.getpid(), signal.SIGKILL)
        while os.environ.get("EYAS_TEST_HANG"):
            time.sleep(1)
        return real(target, tokenizer, proposer, prompt, *args, **kwargs)

    run.run_prompt = run_prompt


if __name__ == "__mp_main__":  # a worker spawned by the eval this file runs below
    _hook()

if __name__ == "__main__" and len(sys.argv) > 1:  # script mode: the eval itself
    from eyas.cli import main

    main(sys.argv[1:])


import pytest  # noqa: E402  (after the script-mode block: the workers need none of the test machinery)


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def _eval(model: Path, prompts: Path, out: Path, marks: Path, **env: str) -> subprocess.Popen:
    """`eyas eval --workers 2` on `prompts` through this file, its workers hooked (see `_hook`)."""
    marks.mkdir()
    args = ["eval", "--model", str(model), "--prompts", str(prompts), "--baseline", "none", "--max-new-tokens", "4",
            "--device", "cpu", "--workers", "2", "--output", str(out)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "EYAS_TEST_MARKS": str(marks),
                   "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]), **env}
    return subprocess.Popen([sys.executable, str(ME), *args], env=environment, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _pids(marks: Path, kind: str) -> set[int]:
    return {int(p.name.rsplit("-", 1)[1]) for p in marks.glob(f"{kind}-*")}


def _alive(pid: int) -> bool:
    """`pid` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _kill(pids: set[int]) -> None:
    """The workers a failed test left running (they would hang on forever)."""
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_worker_killed_is_one_line_naming_its_prompts_and_leaves_no_worker(tiny_llama_dir, prompts_file,
                                                                            tmp_path):
    out, marks = tmp_path / "results.json", tmp_path / "marks"
    # The shares are dealt round-robin: worker 1 answers p0 and p2, worker 2 p1 and p3.
    run = _eval(tiny_llama_dir, prompts_file, out, marks, EYAS_TEST_DIE_ON="p2")
    _, stderr = run.communicate(timeout=300)
    assert run.returncode == 2, stderr[-2000:]
    # Besides transformers' loading bars, one line:
    lines = [line for line in stderr.splitlines() if line.strip() and "Loading weights" not in line]
    assert len(lines) == 1, stderr[-2000:]
    assert lines[0].startswith("eyas eval: error: Worker 1 of 2 (pid ")
    assert "was killed by SIGKILL while answering prompts p0, p2; nothing was written." in lines[0]
    workers = _pids(marks, "worker")
    try:
        assert len(workers) == 2 and not any(_alive(pid) for pid in workers)
    finally:
        _kill(workers)
    assert not out.exists()


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_the_workers_die_with_a_killed_eval(tiny_llama_dir, prompts_file, tmp_path):
    marks = tmp_path / "marks"
    run = _eval(tiny_llama_dir, prompts_file, tmp_path / "results.json", marks, EYAS_TEST_HANG="1")
    _wait_for(lambda: len(_pids(marks, "answering")) == 2 or run.poll() is not None, 240)
    ended = run.poll()
    run.kill()  # SIGKILL: the eval runs no clean-up of its own
    run.wait()
    assert ended is None and len(_pids(marks, "answering")) == 2, run.stderr.read()[-2000:]
    workers = _pids(marks, "worker")
    try:
        assert len(workers) == 2
        assert _wait_for(lambda: not any(_alive(pid) for pid in workers), 10), "a worker outlived the killed eval"
    finally:
        _kill(workers)


def test_more_workers_than_prompts_are_capped_at_one_a_prompt(tiny_llama_dir, tmp_path, capsys, one_thread):
    from eyas.cli import main

    prompts = tmp_path / "one.jsonl"
    prompts.write_text(json.dumps(PROMPTS[0]) + "\n")
    out = tmp_path / "results.json"
    started = time.monotonic()
    with pytest.raises(SystemExit) as e:
        main(["eval", "--model", str(tiny_llama_dir), "--prompts", str(prompts), "--baseline", "none",
              "--max-new-tokens", "4", "--device", "cpu", "--workers", "1000000000000", "--output", str(out)])
    assert e.value.code == 0
    assert time.monotonic() - started < 120
    err = capsys.readouterr().err
    assert "eyas eval: --workers 1000000000000 capped at 1, the number of prompts" in err
    assert [r["prompt_id"] for r in json.loads(out.read_text())["records"]] == ["p0"]
