"""Stored responses live in the router's store, not in a bridge: two bridges, each in front of its
own router, the two routers sharing one PostgreSQL store (real processes, the official ``openai``
client). A response stored through one is read, continued and deleted through the other; another
account sees none of it (404, as if it did not exist)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from postgres_schemas import SessionSchemas
from service_processes import ENGINE_SERVER_BUILT, TINY_MODEL_ID, CachetStack, ServiceProcess

from cachet.models.tiny import write_tiny_model

from .test_end_to_end import TIMEOUT

KEYS = {"sk-owner": "acct-owner", "sk-other": "acct-other"}


@dataclass
class TwoRouters:
    root: Path
    bridges: tuple[ServiceProcess, ServiceProcess]

    def client(self, bridge: int, key: str = "sk-owner") -> openai.OpenAI:
        url = f"http://{self.bridges[bridge].address}/v1"
        return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def two_routers(
    tmp_path_factory: pytest.TempPathFactory, postgres_schemas: SessionSchemas
) -> Iterator[TwoRouters]:
    if not ENGINE_SERVER_BUILT:
        pytest.skip("the engine server (cachet.engine.main) is not built yet")
    url = postgres_schemas.create_now()
    root = tmp_path_factory.mktemp("responses-two-routers")
    keys = {"CACHET_API_KEYS": json.dumps(KEYS)}
    stack = CachetStack(root, write_tiny_model(root / TINY_MODEL_ID))
    try:
        stack.start(
            engines=1, router_env=keys | {"CACHET_STORE_URL": url}, usage_env={"CACHET_STORE_URL": url}
        )
        stack.processes["router-b"] = stack.start_router(name="router-b", CACHET_STORE_URL=url, **keys)
        data = {"CACHET_DATA_DIR": str(root / "bridge-data")}
        first = stack.start_bridge(**keys, **data)
        second = stack.start_bridge(
            "bridge-b", CACHET_BRIDGE_ROUTER_ADDRESS=stack.address("router-b"), **keys, **data
        )
        yield TwoRouters(root, (first, second))
    finally:
        stack.stop()
        print(stack.logs())
        postgres_schemas.drop_now(url)


def test_a_response_stored_through_one_router_is_the_other_s_too(two_routers: TwoRouters) -> None:
    here, there = two_routers.client(0), two_routers.client(1)
    first = here.responses.create(model=TINY_MODEL_ID, input="Where is Paris?", max_output_tokens=2)

    read = there.responses.retrieve(first.id)
    assert read.model_dump(mode="json") == first.model_dump(mode="json")
    items = there.responses.input_items.list(first.id)
    assert [item.id for item in items.data] == [
        item.id for item in here.responses.input_items.list(first.id).data
    ]
    assert items.data[0].content[0].text == "Where is Paris?"

    follow_up = there.responses.create(
        model=TINY_MODEL_ID, previous_response_id=first.id, input="And Rome?", max_output_tokens=2
    )
    # The follow-up's conversation, newest first: its own input, the first answer, the first input.
    chain = here.responses.input_items.list(follow_up.id).data
    assert chain[0].content[0].text == "And Rome?" and chain[-1].id == items.data[0].id
    assert [item.id for item in chain[1:-1]] == [item.id for item in reversed(first.output)]

    there.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        here.responses.retrieve(first.id)
    # Nothing of it was ever in a bridge's own files.
    assert not list(two_routers.root.glob("bridge-data/**/*.sqlite3"))


def test_another_account_can_neither_read_nor_delete_it(two_routers: TwoRouters) -> None:
    owner = two_routers.client(0)
    kept = owner.responses.create(model=TINY_MODEL_ID, input="A secret.", max_output_tokens=1)
    for bridge in (0, 1):
        other = two_routers.client(bridge, key="sk-other")
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(kept.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.input_items.list(kept.id)
        with pytest.raises(openai.NotFoundError) as refused:
            other.responses.delete(kept.id)
        assert refused.value.body["type"] == "not_found_error"
        with pytest.raises(openai.BadRequestError) as follow_up:
            other.responses.create(model=TINY_MODEL_ID, input="Tell me.", previous_response_id=kept.id)
        assert follow_up.value.body["code"] == "previous_response_not_found"
    # Still the owner's, through either router.
    assert two_routers.client(1).responses.retrieve(kept.id).id == kept.id
