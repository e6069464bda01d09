"""The kill -9 matrix: a rank of a checkpointing job SIGKILLed, the resumed job bit-identical."""

import itertools
import os
import random
from typing import NamedTuple

import numpy as np
import pytest
from _jobs import launch

pytest.importorskip("orbax.checkpoint")

# tests/dist/kill_job.py's run: STEPS steps of Adam, a CheckpointManager step every EVERY
# steps, the newest 2 kept.
STEPS, EVERY = 6, 2
SAVED = list(range(EVERY, STEPS + 1, EVERY))
KEPT = SAVED[-2:]
# make test-deep draws its cases with this seed; JAXKV_KILL_SEED=N draws others.
SEED = int(os.environ.get("JAXKV_KILL_SEED", "49"))


class Case(NamedTuple):
    """Rank ``rank`` of a job of ``processes`` SIGKILLs itself in its first attempt, at
    ``when@step`` (tests/dist/kill_job.py: ``push`` at step ``step``'s push, ``save`` inside the
    save of step ``step``, ``saved`` right after it is complete); then the job is restarted by
    the launcher (``restart="launcher"``: ``--max-restarts 1``) or launched again once the
    first launch has failed (``"again"``)."""

    processes: int
    rank: int
    when: str
    step: int
    restart: str

    def __str__(self):
        return f"{self.processes}p-rank{self.rank}-{self.when}@{self.step}-{self.restart}"

    def resumes_at(self):
        """The steps the resumed job may start at: the latest complete step when the rank died
        (at a push, the save before it may still have been in progress)."""
        if self.when == "saved":
            return {self.step}
        if self.when == "save":
            return {self.step - EVERY}
        last = self.step - self.step % EVERY
        return {last, max(last - EVERY, 0)}


def matrix(seed):
    """One case per process count, moment and way to restart, each with a rank and a step
    drawn with ``seed``."""
    rng = random.Random(seed)
    moments = {"push": range(STEPS), "save": SAVED, "saved": SAVED}
    cases = []
    for processes, when, restart in itertools.product((2, 3), moments, ("launcher", "again")):
        rank, step = rng.randrange(processes), rng.choice(moments[when])
        cases.append(Case(processes, rank, when, step, restart))
    return cases


# Each moment and each way to restart, the coordinator's process (0) killed once. make
# test-whole runs the first (the coordinator killed inside a save, the job launched again: the
# case that leaves a half-written step behind); tests/test_checkpoint_manager.py and
# tests/test_launch.py kill ranks of other jobs there too. make test-deep runs the others.
QUICK = [
    Case(2, 0, "save", 4, "again"),
    Case(2, 1, "push", 3, "launcher"),
    Case(2, 1, "saved", 4, "launcher"),
]
DEEP = [c for c in matrix(SEED) if c not in QUICK]


def run(processes, work, *args, restarts=0):
    options = ["--max-restarts", str(restarts)] if restarts else []
    out = launch(processes, "kill_job.py", work, STEPS, EVERY, *args, options=options, timeout=400)
    return out.returncode, out.stdout + out.stderr


def final(work):
    with np.load(os.path.join(work, "final.npz"), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def steps_kept(work):
    """The steps in ``work/ckpt``, once checked that nothing else is there (no temporary step
    or file that a save cut short left) and that the newest 2 are complete (their manifest in
    place). An older step may be left too, where the rank died after a step was complete but
    before orbax deleted the oldest (max_to_keep is applied again at the next save); orbax
    deletes a step's files in place, so one killed part way through is left listed, without
    its manifest (restoring it is a KVStoreError)."""
    ckpt = os.path.join(work, "ckpt")
    names = os.listdir(ckpt)
    assert all(n.isdigit() for n in names), names
    left = [
        os.path.relpath(os.path.join(d, n), ckpt)
        for d, dirs, files in os.walk(ckpt)
        for n in dirs + files
        if "tmp" in n or n.startswith(".jaxkv")
    ]
    assert not left, left
    steps = sorted(map(int, names))
    for step in steps[-2:]:
        assert os.path.isfile(os.path.join(ckpt, str(step), "kv", "manifest.json")), step
    return steps


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final parameters of the job run without a fault, per process count (run once)."""
    runs = {}

    def of(processes):
        if processes not in runs:
            work = tmp_path_factory.mktemp(f"uninterrupted{processes}")
            code, out = run(processes, work)
            assert code == 0, out[-5000:]
            for rank in range(processes):
                assert f"rank {rank} starts at step 0" in out, out[-5000:]
            assert steps_kept(work) == KEPT
            runs[processes] = final(work)
        return runs[processes]

    return of


def check(case, work, want):
    """Run ``case`` in ``work``; its final parameters must be ``want``'s, bit for bit."""
    fault = f"{case.rank}:{case.when}@{case.step}"
    restarts = 1 if case.restart == "launcher" else 0
    code, out = run(case.processes, work, fault, restarts=restarts)
    killed = f"rank {case.rank} kills itself ({case.when}@{case.step})"
    assert killed in out and f"process {case.rank} was killed by SIGKILL" in out, out[-5000:]
    if case.restart == "launcher":
        assert "restarting the job (restart 1 of 1)" in out, out[-5000:]
    else:
        assert code != 0 and "restarting" not in out, out[-5000:]
        assert not os.path.exists(work / "final.npz")
        code, again = run(case.processes, work, fault)
        out += again
    assert code == 0, out[-5000:]
    # Each rank started twice: at step 0, then at the latest step complete when the rank died.
    for rank in range(case.processes):
        starts = [
            int(line.rsplit(" ", 1)[1])
            for line in out.splitlines()
            if f"] rank {rank} starts at step " in line
        ]
        assert len(starts) == 2 and starts[0] == 0, out[-5000:]
        assert starts[1] in case.resumes_at(), out[-5000:]
    got = final(work)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert np.array_equal(got[k], want[k]), (k, np.abs(got[k] - want[k]).max())
    steps = steps_kept(work)  # the newest 2, and maybe an older one (see steps_kept)
    assert steps[-2:] == KEPT and set(steps) <= set(SAVED), steps


@pytest.mark.parametrize(
    "case",
    [QUICK[0]] + [pytest.param(c, marks=pytest.mark.deep) for c in QUICK[1:]],
    ids=str,
)
def test_a_killed_rank_resumes_to_the_uninterrupted_parameters(case, tmp_path, uninterrupted):
    """Each moment and each way to restart, on 2 processes (QUICK; make test-whole: the first)."""
    check(case, tmp_path, uninterrupted(case.processes))


@pytest.mark.deep
@pytest.mark.parametrize("case", DEEP, ids=str)
def test_the_random_kill_matrix(case, tmp_path, uninterrupted):
    """make test-deep: one case per process count, moment and way to restart, each killing a
    rank and at a step drawn with ``SEED``."""
    check(case, tmp_path, uninterrupted(case.processes))
