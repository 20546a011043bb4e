"""The decision for one record, as plain data in and out: prepare, answer (tiers,
stages, chunking, packing, window fitting, repair, fallbacks), outcomes and their cost.
No Faust, no aiokafka, no HTTP: the LLM comes in through `streams.llm.client`."""
