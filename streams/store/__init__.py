"""The task store: changelog-backed maps per task partition (results, dead letters, task
states, the batch ledger, sessions) read before the partition's records are served
(`taskstore`), kept on local disk and bounded (`local`)."""
