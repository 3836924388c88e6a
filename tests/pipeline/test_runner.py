"""The pipeline runner: stages in order, the first response ends the run, a failure names its stage and undoes
what earlier stages left to undo; and each endpoint kind's stage list."""

from __future__ import annotations

import asyncio

import pytest

from psrl.router.errors import BadRequest
from psrl.router.pipeline import stages
from psrl.router.pipeline.runner import Pipeline, RequestContext, Stage
from psrl.serving.http1 import Response


def _ctx() -> RequestContext:
    return RequestContext(http=None, route="/test")  # type: ignore[arg-type]  # these stages never read it


def _recording(
    log: list[str], name: str, *, respond: bool = False, fail: BaseException | None = None, waits: bool = True
) -> Stage:
    """A stage that logs its run and leaves an undo step; `waits`: a coroutine function, else a plain one."""

    def run(services: object, ctx: RequestContext) -> None:
        log.append(name)
        ctx.on_failure[name] = lambda: _undo(log, name)
        if fail is not None:
            raise fail
        if respond:
            ctx.response = Response(name.encode())

    async def run_waiting(services: object, ctx: RequestContext) -> None:
        await asyncio.sleep(0)
        run(services, ctx)

    return Stage(name, run_waiting if waits else run)


async def _undo(log: list[str], name: str) -> None:
    log.append(f"undo {name}")


@pytest.mark.parametrize("waits", [True, False], ids=["coroutine-stages", "plain-stages"])
def test_stages_run_in_order_until_one_responds(waits: bool) -> None:
    log: list[str] = []
    a, c = _recording(log, "a", waits=waits), _recording(log, "c", waits=waits)
    pipeline = Pipeline("t", [a, _recording(log, "b", respond=True, waits=not waits), c])
    response = asyncio.run(pipeline.run(object(), _ctx()))
    assert log == ["a", "b"]
    assert response.body == b"b"


@pytest.mark.parametrize("waits", [True, False], ids=["coroutine-stages", "plain-stages"])
def test_a_failure_undoes_newest_first_and_names_its_stage(waits: bool) -> None:
    log: list[str] = []
    failing = _recording(log, "c", fail=BadRequest("no"), waits=waits)
    pipeline = Pipeline("t", [_recording(log, "a", waits=not waits), _recording(log, "b", waits=waits), failing])
    with pytest.raises(BadRequest) as e:
        asyncio.run(pipeline.run(object(), _ctx()))
    assert e.value.stage == "c"
    assert log == ["a", "b", "c", "undo c", "undo b", "undo a"]


def test_an_unexpected_error_carries_a_note_naming_the_stage() -> None:
    pipeline = Pipeline("chat", [_recording([], "prepare", fail=KeyError("x"))])
    with pytest.raises(KeyError) as e:
        asyncio.run(pipeline.run(object(), _ctx()))
    assert "in the chat pipeline's prepare stage" in e.value.__notes__


def test_cancellation_undoes_too() -> None:
    log: list[str] = []

    async def main() -> None:
        started = asyncio.Event()

        async def hang(services: object, ctx: RequestContext) -> None:
            started.set()
            await asyncio.Event().wait()

        task = asyncio.create_task(Pipeline("t", [_recording(log, "a"), Stage("hang", hang)]).run(object(), _ctx()))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert log == ["a", "undo a"]


def test_a_failing_undo_does_not_mask_the_stage_error() -> None:
    async def leaves_a_bad_undo(services: object, ctx: RequestContext) -> None:
        async def bad() -> None:
            raise RuntimeError("undo failed")

        ctx.on_failure["bad"] = bad

    async def fails(services: object, ctx: RequestContext) -> None:
        raise BadRequest("the real error")

    pipeline = Pipeline("t", [Stage("a", leaves_a_bad_undo), Stage("b", fails)])
    with pytest.raises(BadRequest, match="the real error"):
        asyncio.run(pipeline.run(object(), _ctx()))


def test_a_stage_taking_its_undo_out_leaves_nothing_to_undo() -> None:
    log: list[str] = []

    async def settles(services: object, ctx: RequestContext) -> None:
        del ctx.on_failure["a"]

    pipeline = Pipeline(
        "t", [_recording(log, "a"), Stage("settle", settles), _recording(log, "b", fail=BadRequest("x"))]
    )
    with pytest.raises(BadRequest):
        asyncio.run(pipeline.run(object(), _ctx()))
    assert log == ["a", "b", "undo b"]


def test_a_pipeline_that_never_responds_is_a_bug() -> None:
    with pytest.raises(AssertionError, match="ended without a response"):
        asyncio.run(Pipeline("t", [_recording([], "a")]).run(object(), _ctx()))


def test_each_endpoint_kind_runs_its_stages_in_this_order() -> None:
    chat = ("read", "route", "parse", "prepare", "execute", "record", "respond")
    assert stages.CHAT.stage_names == chat
    assert stages.RESPONSES.stage_names == chat
    assert stages.MESSAGES.stage_names == chat
    assert stages.COMPLETION.stage_names == ("read", "route", "parse", "prepare", "execute", "respond")
    assert stages.GENERATE.stage_names == ("read", "parse", "prepare", "execute", "respond")  # gRPC workers only
