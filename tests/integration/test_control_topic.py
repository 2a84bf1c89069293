"""The control topic keeps the latest weights however old they are: compacted only, also when an
older kvgate created it with ``compact,delete``; pre-warm advice is tombstoned."""

from __future__ import annotations

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from streams.kafka import ensure_topics
from streams.settings import KafkaSettings
from streams.topics import CONTROL
from tests.conftest import wait_until

pytestmark = pytest.mark.integration


async def _policy(admin: AIOKafkaAdminClient, name: str) -> str | None:
    res = ConfigResource(ConfigResourceType.TOPIC, name, configs={"cleanup.policy": None})
    for response in await admin.describe_configs([res]):
        for resource in response.resources:
            for entry in resource[4]:
                if entry[0] == "cleanup.policy":
                    return str(entry[1])
    return None


async def test_an_old_control_topic_becomes_compacted_only(kafka_settings: KafkaSettings) -> None:
    name = CONTROL.name(kafka_settings.namespace)
    admin = AIOKafkaAdminClient(**kafka_settings.client_options())
    await admin.start()
    try:
        await admin.create_topics(
            [
                NewTopic(
                    name,
                    1,
                    1,
                    topic_configs={"cleanup.policy": "compact,delete", "retention.ms": "86400000"},
                )
            ]
        )

        # the broker knows a new topic's config a moment after it accepted the creation
        async def created() -> bool:
            return await _policy(admin, name) == "compact,delete"

        await wait_until(created, 10, "the old-style topic visible", 0.1)
        await ensure_topics(kafka_settings)
        assert await _policy(admin, name) == "compact"
        await ensure_topics(kafka_settings)  # idempotent
        assert await _policy(admin, name) == "compact"
    finally:
        await admin.close()
