"""Which warnings of a repeated cause are written (pure logic, injected clock)."""

from elasticrl.repeats import Repeats


def test_repeated_warnings_are_written_once_a_window_with_the_count_left_out():
    now = [0.0]
    repeats = Repeats(10.0, clock=lambda: now[0], max_causes=2)
    assert repeats.take("a").left_out == 0  # the first of a cause: written
    assert [repeats.take("a") for _ in range(3)] == [None, None, None]
    assert repeats.take("b").left_out == 0  # another cause is written at once
    now[0] = 10.0
    note = repeats.take("a")  # the window passed: written, with the count
    assert (note.left_out, note.count, note.lasting_s) == (3, 5, 10.0) and repeats.take("a") is None
    assert repeats.take("c").left_out == 0  # a third cause forgets the oldest ("a")
    assert repeats.take("a").count == 1


def test_an_outage_is_warned_about_once_a_while_not_at_every_retry():
    # Found by an operator: a coordinator down for a minute wrote ~3 warnings a second per worker.
    now = [0.0]
    outage = Repeats(10.0, clock=lambda: now[0])
    said = []
    for _ in range(25):  # a retry every 0.5 s for 12 s
        note = outage.take()
        said.append(None if note is None else note.outage())
        now[0] += 0.5
    assert said[0] == "" and said[20] == " (failing for 10s, 21 attempts)"
    assert [i for i, s in enumerate(said) if s is not None] == [0, 20]
    outage.ok()  # back: the next failure is a new outage, warned about at once
    assert outage.take().outage() == "" and outage.take() is None
