"""The OpenAI Responses API (`client.responses.create`) through kvmesh-proxy to engine-sim."""

import openai
import pytest

from conftest import ALIAS, MODEL


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)


def test_create_non_streaming(client, engines):
    raw = client.responses.with_raw_response.create(
        model=MODEL,
        instructions="Answer briefly.",
        input="What does a KV cache hold?",
        max_output_tokens=8,
    )
    response = raw.parse()
    assert response.object == "response"
    assert response.status == "completed"
    assert response.model == MODEL
    assert response.output_text
    message = response.output[0]
    assert message.type == "message" and message.role == "assistant"
    assert response.usage.output_tokens == 8
    assert response.usage.input_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + 8
    served = raw.headers["x-kvmesh-instance"]
    assert served in {f"http://{a}" for name, a in engines.listeners.items() if name.startswith("engine-")}
    assert raw.headers.get("x-request-id")


def test_create_with_message_items_and_alias(client):
    response = client.responses.create(
        model=ALIAS,
        input=[
            {"role": "user", "content": "First question."},
            {"role": "assistant", "content": "First answer."},
            {"role": "user", "content": [{"type": "input_text", "text": "Second question."}]},
        ],
        max_output_tokens=4,
    )
    assert response.status == "completed"
    assert response.model == MODEL
    assert response.usage.output_tokens == 4


def test_create_streaming(client):
    stream = client.responses.create(
        model=MODEL,
        input="Stream a few words.",
        max_output_tokens=6,
        stream=True,
    )
    events = list(stream)
    types = [event.type for event in events]
    assert types[0] == "response.created"
    assert types[-1] == "response.completed"
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) == 6
    done = next(event for event in events if event.type == "response.output_text.done")
    assert done.text == "".join(deltas)
    final = events[-1].response
    assert final.status == "completed"
    assert final.output_text == done.text
    assert final.usage.output_tokens == 6
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(len(events)))


def test_stream_and_non_stream_agree(client):
    args = dict(model=MODEL, input="Same prompt, same answer.", max_output_tokens=5)
    whole = client.responses.create(**args)
    streamed = [e for e in client.responses.create(stream=True, **args) if e.type == "response.completed"]
    assert streamed[0].response.output_text == whole.output_text


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="no-such-model", input="x")
    assert MODEL in err.value.message
