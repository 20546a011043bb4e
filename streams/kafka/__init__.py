"""The Kafka edge: the app's composition root, the thin agent (headers -> core ->
writes -> acks), the task store, exactly-once transactions, topics, clients, the
read-to-end rule, write limits, routing, the bounded shutdown. All private Faust
access lives in `faust_private`."""
