"""The worker's runtime: the Faust app and its agents at the edge (`app`, `agent`, `take`,
the Faust adapter `faust_private`), the record's writes (`writer`, `eos`), its stop
(`shutdown`), the batch lane's parked records (`parked`), source topics (`sources`),
drift baselines (`drift`), and starting it (`run`)."""
