"""Exactly-once's transactions without a broker: one outcome's writes held in one
transaction — the commit waits for the hold, and the hold's own writes are never made to
wait for that commit (which would wait for them in turn)."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import pytest
from aiokafka.errors import IllegalOperation, ProducerFenced
from aiokafka.producer.transaction_manager import TransactionManager, TransactionState

from streams.settings import load_settings
from streams.store.taskstore import PartitionLost
from streams.worker import eos as eos_module
from streams.worker.eos import Transactions


class Producer:
    """A transactional producer's calls, recorded in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def send(self, topic: str, **_: Any) -> asyncio.Future[Any]:
        self.calls.append(f"send {topic}")
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        done.set_result(type("Meta", (), {"offset": len(self.calls)})())
        return done

    async def send_offsets_to_transaction(self, *_: Any) -> None:
        self.calls.append("offsets")

    async def commit_transaction(self) -> None:
        self.calls.append("commit")

    async def begin_transaction(self) -> None:
        self.calls.append("begin")


async def _owning(partition: int) -> tuple[Transactions, Producer, Any]:
    eos = Transactions(load_settings(processing_guarantee="exactly_once"))
    producer = Producer()
    part = eos_module._Partition(producer)  # type: ignore[arg-type]  # the one it would start
    part.open.set()
    eos._parts[partition] = part  # as `assign` leaves it once the producer began
    return eos, producer, part


async def test_a_commit_waits_for_a_held_outcome_whose_writes_go_on_meanwhile() -> None:
    eos, producer, part = await _owning(3)
    async with eos.held(3):
        await eos.send("llm-results", b"k", b"v", 3)
        committing = asyncio.create_task(eos.commit(3, part))
        await asyncio.sleep(0.05)
        assert not committing.done() and not part.open.is_set()  # the commit waits for us
        # The hold's next writes go in at once, into the same transaction.
        await asyncio.wait_for(eos.send("sink", b"k", b"v", 0, via=3), 1)
        await asyncio.wait_for(eos.send("state", b"k", b"v", 3), 1)
    await asyncio.wait_for(committing, 1)
    assert producer.calls == ["send llm-results", "send sink", "send state", "commit", "begin"]


async def test_a_write_outside_the_hold_waits_for_the_commit_under_way() -> None:
    eos, producer, part = await _owning(1)
    async with eos.held(1):
        await eos.send("llm-results", b"k", b"v", 1)
        committing = asyncio.create_task(eos.commit(1, part))
        await asyncio.sleep(0.05)
        # Another task's write (its own context: not in the hold), while the commit waits.
        other = asyncio.create_task(eos.send("llm-results", b"k2", b"v", 1),
                                    context=contextvars.Context())  # fmt: skip
        await asyncio.sleep(0.05)
        assert not other.done()  # it goes into the next transaction
    await asyncio.wait_for(asyncio.gather(committing, other), 1)
    assert producer.calls == ["send llm-results", "commit", "begin", "send llm-results"]


async def test_a_hold_on_a_partition_not_owned_lets_its_writes_say_so() -> None:
    eos, producer, _part = await _owning(1)
    async with eos.held(5):  # not this worker's: nothing to hold, the writes are told
        with pytest.raises(PartitionLost):
            await eos.send("llm-results", b"k", b"v", 5)
    assert producer.calls == []


async def _fenced_in_the_background(
    partition: int,
) -> tuple[Transactions, Producer, Any, list[int]]:
    """A partition whose producer carries aiokafka's own transaction manager, in a
    transaction, and sends as aiokafka's do: refused (IllegalOperation) unless the
    transaction is open. Its `on_fenced` calls are in the list returned."""
    fenced: list[int] = []

    async def on_fenced(p: int) -> None:
        fenced.append(p)

    eos, producer, part = await _owning(partition)
    eos.on_fenced = on_fenced
    manager = TransactionManager(f"app-eos-{partition}", 60_000)
    manager.set_pid_and_epoch(7, 0)
    manager.begin_transaction()
    producer._txn_manager = manager  # type: ignore[attr-defined]
    send = producer.send

    async def send_as_aiokafka_does(topic: str, **kwargs: Any) -> asyncio.Future[Any]:
        await asyncio.sleep(0)  # its wait for the topic's metadata
        if not manager.is_in_transaction():
            raise IllegalOperation("Can't send messages while not in transaction")
        return await send(topic, **kwargs)

    producer.send = send_as_aiokafka_does  # type: ignore[method-assign]
    return eos, producer, part, fenced


async def test_a_commit_on_a_producer_fenced_in_the_background_restarts_the_partition() -> None:
    """The producer's sender died fenced (a newer epoch of its transactional id) while the
    partition's transaction was open: aiokafka then fails `commit_transaction` with an
    assertion of its state machine. The commit says the partition is lost, as a fence met
    by a send does, and does not stop the worker."""
    eos, producer, part, fenced = await _fenced_in_the_background(2)
    manager = producer._txn_manager  # type: ignore[attr-defined]

    async def commit_as_aiokafka_does() -> None:
        manager.committing_transaction()  # asserts: FATAL_ERROR -> COMMITTING

    producer.commit_transaction = commit_as_aiokafka_does  # type: ignore[method-assign]
    await eos.send("llm-results", b"k", b"v", 2)
    manager.fatal_error(ProducerFenced())  # what the dead sender leaves
    assert manager.state is TransactionState.FATAL_ERROR
    with pytest.raises(PartitionLost):
        await eos.commit(2, part)
    await asyncio.sleep(0)
    assert part.lost and fenced == [2]
    assert producer.calls == ["send llm-results"]  # nothing committed, nothing begun


@pytest.mark.parametrize("when", ["before the send", "while the send waits"])
async def test_a_send_into_a_producer_fenced_in_the_background_restarts_the_partition(
    when: str,
) -> None:
    """The sender died fenced before a send, or while the send waited for metadata:
    aiokafka refuses the send with IllegalOperation. The send says the partition is lost
    (restarted by on_fenced), as a fence met by a send's delivery does, and does not stop
    the worker through the writer's retries."""
    eos, producer, part, fenced = await _fenced_in_the_background(4)
    manager = producer._txn_manager  # type: ignore[attr-defined]
    if when == "before the send":
        manager.fatal_error(ProducerFenced())
    else:
        asyncio.get_running_loop().call_soon(manager.fatal_error, ProducerFenced())
    with pytest.raises(PartitionLost):
        await eos.send("llm-results", b"k", b"v", 4)
    await asyncio.sleep(0)
    assert part.lost and fenced == [4]
    assert producer.calls == []


async def test_a_send_refused_for_another_reason_is_not_taken_for_a_fence() -> None:
    """A producer in aiokafka's abortable state (a write refused by an ACL, say) refuses
    sends too: that is no fence, and the refusal reaches the writer as it is."""
    eos, producer, part, fenced = await _fenced_in_the_background(5)
    manager = producer._txn_manager  # type: ignore[attr-defined]
    manager.error_transaction(RuntimeError("topic authorization failed"))
    manager._transaction_waiter.exception()  # retrieved, as aiokafka's waiter would be
    with pytest.raises(IllegalOperation):
        await eos.send("llm-results", b"k", b"v", 5)
    assert not part.lost and fenced == []


class Starting(Producer):
    """A producer whose start is refused, or waits (InitProducerId) until cancelled."""

    def __init__(self, refuse: bool) -> None:
        super().__init__()
        self.refuse = refuse

    async def start(self) -> None:
        self.calls.append("start")
        if self.refuse:
            raise IllegalOperation("TransactionalIdAuthorizationFailed")
        await asyncio.Event().wait()

    async def stop(self) -> None:
        self.calls.append("stop")


@pytest.mark.parametrize("refuse", [True, False])
async def test_a_partitions_producer_that_does_not_start_is_stopped(
    monkeypatch: pytest.MonkeyPatch, refuse: bool
) -> None:
    """Refused (no ACL for its transactional id), or cancelled by the next rebalance while
    it waited for its id: its client's connections and tasks stayed for the worker's life,
    one more at every try."""
    made: list[Starting] = []

    def producer(*_: Any, **__: Any) -> Starting:
        made.append(Starting(refuse))
        return made[-1]

    monkeypatch.setattr(eos_module.clients, "producer", producer)
    eos = Transactions(load_settings(processing_guarantee="exactly_once"))
    assigning = asyncio.create_task(eos.assign({4}))
    if refuse:
        with pytest.raises(IllegalOperation):
            await assigning
    else:
        await asyncio.sleep(0.01)
        assigning.cancel()
        with pytest.raises(asyncio.CancelledError):
            await assigning
    assert made[0].calls == ["start", "stop"]
    assert eos._parts == {} and eos._starting == {}
    if eos._committer is not None:
        eos._committer.cancel()


async def test_an_idle_partition_still_lets_the_store_take_what_committed_before() -> None:
    """With nothing to commit, the store is told all the partition wrote is committed: a
    flush its disk refused is tried again then (records may be waiting for it); a
    partition lost is not."""
    eos, producer, part = await _owning(2)
    told: list[int] = []
    eos.on_committed = told.append
    await eos.commit(2, part)  # nothing written since the last commit
    assert told == [2] and producer.calls == []
    await eos.send("llm-results", b"k", b"v", 2)
    await eos.commit(2, part)
    assert told == [2, 2] and producer.calls == ["send llm-results", "commit", "begin"]
    part.gone()  # fenced: what it staged is not the store's to keep
    await eos.commit(2, part)
    assert told == [2, 2]


async def test_a_fenced_partitions_producer_whose_stop_raises_the_fence_is_forgotten() -> None:
    """aiokafka's `stop()` awaits its sender, which died of the fence (ProducerFenced from
    the offsets' request): `forget` raised it, `on_fenced`'s restart ended there before
    asking the group to rejoin, and the partition was never run again (seen in
    tests/integration/test_eos.py: 145 of 1,500 tasks never answered)."""
    eos, producer, part = await _owning(0)

    async def stop_as_aiokafka_does() -> None:
        raise ProducerFenced()

    producer.stop = stop_as_aiokafka_does  # type: ignore[attr-defined]
    await asyncio.wait_for(eos.forget(0), 1)
    assert 0 not in eos._parts and part.lost
