"""The edge scheduler alone (edge_worker/scheduler.py): views in, actions out, no model, no sockets."""

from specrelay.edge_worker.scheduler import EdgeScheduler, Phase, SessionView


def views(*phases, predraft=True):
    return [SessionView(i, phase, predraft=predraft and phase is Phase.IN_FLIGHT) for i, phase in enumerate(phases)]


def test_real_drafts_go_before_predrafts():
    a = EdgeScheduler(8).step(views(Phase.IN_FLIGHT, Phase.READY, Phase.IN_FLIGHT, Phase.READY))
    assert a.draft == [1, 3] and a.predraft == [] and sorted(a.wait) == [0, 2]
    a = EdgeScheduler(8).step(views(Phase.IN_FLIGHT, Phase.IN_FLIGHT))  # nothing to draft: the pre-drafts run
    assert a.draft == [] and a.predraft == [0, 1] and a.wait == []


def test_a_session_in_flight_is_never_drafted():
    a = EdgeScheduler(8).step(views(Phase.IN_FLIGHT, Phase.IN_FLIGHT, predraft=False))
    assert a.draft == [] and a.predraft == [] and a.wait == [0, 1] and a.dropped == []
    for s in (EdgeScheduler(8), EdgeScheduler()):
        a = s.step(views(Phase.IN_FLIGHT, Phase.READY, Phase.IN_FLIGHT, predraft=False))
        assert a.draft == [1] and 0 not in a.draft + a.predraft and 2 not in a.draft + a.predraft


def test_a_pending_resample_goes_before_the_draft():
    a = EdgeScheduler().step(views(Phase.RESAMPLE, Phase.READY, Phase.RESAMPLE))
    assert a.resample == [0, 2] and a.draft == [1]
    a = EdgeScheduler(1).step(views(Phase.RESAMPLE, Phase.IN_FLIGHT))  # a resample is no draft: pre-drafts may run
    assert a.resample == [0] and a.draft == [] and a.predraft == [1]


def test_done_sessions_are_dropped():
    a = EdgeScheduler(8).step(views(Phase.DONE, Phase.READY, Phase.DONE, Phase.IN_FLIGHT))
    assert a.dropped == [0, 2] and a.draft == [1]
    assert not {0, 2} & set(a.draft + a.predraft + a.resample + a.wait)


def test_the_batch_size_is_bounded():
    a = EdgeScheduler(2).step(views(*[Phase.READY] * 5))
    assert a.draft == [0, 1] and a.wait == [2, 3, 4]  # in order: the oldest jobs first, the rest next step
    a = EdgeScheduler(2).step(views(*[Phase.IN_FLIGHT] * 3))
    assert a.predraft == [0, 1] and a.wait == [2]
    a = EdgeScheduler().step(views(*[Phase.READY] * 100))  # unbounded: every ready session in one batch
    assert a.draft == list(range(100)) and a.wait == []


def test_every_session_gets_exactly_one_action():
    phases = [Phase.READY, Phase.RESAMPLE, Phase.IN_FLIGHT, Phase.DONE] * 6
    for batch in (None, 1, 3, 64):
        a = EdgeScheduler(batch).step(views(*phases))
        keys = a.draft + a.predraft + a.resample + a.wait + a.dropped
        assert sorted(keys) == list(range(len(phases)))
