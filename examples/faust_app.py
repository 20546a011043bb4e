"""llm-streams inside your own Faust app: a topic of plain comments (no envelope) analysed
with the worker's processing (streams.api), the answers written to a topic of yours.

    KAFKA_BROKER=kafka://localhost:9092 LLM_STREAMS_LLM__BASE_URL=http://… \\
        faust -A examples.faust_app worker -l info
"""

import os

import faust

from streams.api import Analyzer
from streams.contract.records import Source

app = faust.App("comment-example", broker=os.environ.get("KAFKA_BROKER", "kafka://localhost:9092"))
comments = app.topic("shop-comments", key_serializer="raw", value_serializer="raw")
answers = app.topic("shop-comment-answers", key_serializer="raw", value_serializer="raw")
analyzer = Analyzer()  # the LLM_STREAMS_* settings, as the worker reads them


@app.agent(comments)
async def analyse(stream: faust.Stream) -> None:
    async for event in stream.events():
        m = event.message
        task = {"task_id": f"comment-{m.partition}-{m.offset}", "pipeline": "comment-analysis",
                "input": {"text": event.value.decode(errors="replace")}}  # fmt: skip
        outcome = await analyzer.analyze(task, source=Source(topic=m.topic,
                                                             partition=m.partition,
                                                             offset=m.offset))  # fmt: skip
        # A result or a dead letter, keyed by its result key, as the worker writes them.
        await answers.send(key=outcome.key.encode(), value=outcome.value)
