"""Granting ACLs on a test cluster with the KRaft StandardAuthorizer, through the admin
protocol as a super user (aiokafka has the CreateAcls request but no admin call for it)."""

from __future__ import annotations

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.protocol.admin import CreateAclsRequest

from streams.kafka.acls import Acl

# Kafka's codes (org.apache.kafka.common.acl / resource).
RESOURCE = {"topic": 2, "group": 3, "cluster": 4, "transactional_id": 5}
OPERATION = {"ALL": 2, "READ": 3, "WRITE": 4, "CREATE": 5, "DELETE": 6, "ALTER": 7,
             "DESCRIBE": 8, "CLUSTER_ACTION": 9, "DESCRIBE_CONFIGS": 10, "ALTER_CONFIGS": 11,
             "IDEMPOTENT_WRITE": 12}  # fmt: skip
LITERAL, PREFIXED = 3, 4
ALLOW = 3


async def grant(bootstrap: str, principal: str, acls: list[Acl]) -> None:
    """Allow `principal` (e.g. `User:worker`) each operation of `acls`."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        node = admin._client.cluster.brokers().pop().nodeId  # noqa: SLF001  # see module note
        for acl in acls:
            for operation in acl.operations:
                request = CreateAclsRequest(
                    RESOURCE[acl.resource], acl.name, PREFIXED if acl.prefixed else LITERAL,
                    principal, "*", OPERATION[operation], ALLOW,
                )  # fmt: skip
                response = await admin._client.send(node, request)  # noqa: SLF001
                for code, message in response.creation_responses:
                    if code:
                        raise RuntimeError(f"CreateAcls {acl} {operation}: {code} {message}")
    finally:
        await admin.close()


__all__ = ["grant"]
