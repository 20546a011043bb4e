"""Kafka plumbing every command uses: clients built from one security configuration
(`clients`, `security`), topics and what they take (`topics`, `limits`), reading to the
real end (`scan`), a task's partition (`routing`), publishing tasks (`publisher`), and
the least ACLs (`acls`)."""
