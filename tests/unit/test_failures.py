"""Infrastructure failures end a command with what failed and what to do, found through the
exception's chain and groups; anything else keeps its traceback."""

from __future__ import annotations

import errno

from aiokafka.errors import KafkaConnectionError
from redis.exceptions import ConnectionError as RedisConnectionError

from admission.exceptions import AdmissionError
from deploy.failures import explain
from streams.exceptions import StreamError


def _raised(exc: BaseException, cause: BaseException) -> BaseException:
    try:
        raise exc from cause
    except BaseException as e:
        return e


def test_kafka_down_wrapped_in_a_group_is_one_sentence_with_the_fix() -> None:
    inner = _raised(StreamError("cannot reach 127.0.0.1:1"), KafkaConnectionError("refused"))
    text = explain(ExceptionGroup("startup", [inner]))
    assert text is not None and text.startswith("Kafka is unreachable")
    assert "127.0.0.1:1" in text and "kafka.sh start" in text
    assert len(text.splitlines()) == 2


def test_redis_and_a_port_in_use_name_their_fix() -> None:
    redis = explain(_raised(AdmissionError("store unavailable"), RedisConnectionError("refused")))
    assert redis is not None and "redis.sh start" in redis
    in_use = OSError(errno.EADDRINUSE, "address already in use")
    text = explain(_raised(RuntimeError("could not start"), in_use))
    assert text is not None and text.startswith("cannot listen") and "port" in text


def test_a_bug_keeps_its_traceback() -> None:
    assert explain(ValueError("a bug")) is None
    assert explain(_raised(KeyError("x"), TypeError("y"))) is None
