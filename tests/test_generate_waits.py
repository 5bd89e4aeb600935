"""`specrelay generate` started beside a cloud worker that is still loading waits for it, saying so once, and
then generates (issue 21: a script that started both at once failed with "no live cloud worker" within 5 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from specrelay.cluster import LocalCluster

pytestmark = [pytest.mark.process, pytest.mark.timeout(240)]


def test_generate_waits_for_a_worker_that_is_starting(tiny_pair):
    target, draft = tiny_pair
    cluster = LocalCluster(str(target), workers=0, threads=1)
    with cluster:
        gen = subprocess.Popen([sys.executable, "-m", "specrelay.cli", "generate", "--broker", cluster.frontend,
                                "--draft-model", str(draft), "--prompt", "def f():", "--max-new-tokens", "4",
                                "--temperature", "0", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=dict(os.environ, OMP_NUM_THREADS="1", SPECRELAY_THREADS="1"))
        time.sleep(4)  # generate is waiting: no worker yet
        assert gen.poll() is None
        cluster.start_worker()
        out, err = gen.communicate(timeout=120)
    assert gen.returncode == 0, err[-2000:]
    assert err.count("waiting for a cloud worker behind the broker at") == 1, err[-2000:]
    assert len(json.loads(out.splitlines()[0])["token_ids"]) == 4
