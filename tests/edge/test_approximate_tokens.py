"""No tokenizer configured for a model (the default): the router's token ids are approximate,
and the index — built from the engines' own KV events, in the engines' tokens — matches them only
where an engine happens to tokenize the same way. The router's memory of where it had each
prompt prefilled then counts on every node, as it does on nodes without KV events: routing with
working events is never worse than with none."""

from __future__ import annotations

from tests.edgekit import MODEL, bearer, completion, edge


async def test_an_approximate_prompt_finds_the_node_that_prefilled_it() -> None:
    # recent prefills off: only the router's longer memory can know where the prompt went
    async with edge(engines=3, router={"recent_prefill_ttl_s": 0}) as e:
        body = completion("the same long system prompt " * 60)
        status, _, headers = await e.call("POST", "/v1/completions", body, bearer("sk-alpha"))
        assert status == 200
        node = headers["X-Kvgate-Node"]
        status, d, _ = await e.call(
            "POST", "/v1/kvgate/decide?tenant=alpha", body, base=e.admin_url
        )
        assert status == 200 and d["prompt_blocks"] > 10
        hits = {c["node_id"]: c["hit_blocks"] for c in d["candidates"]}
        assert hits[node] >= d["prompt_blocks"] - 1, hits  # it holds the prompt
        assert all(h == 0 for n, h in hits.items() if n != node), hits
        assert d["chosen_node"] == node
        other = completion("a different prompt altogether " * 60, model=MODEL)
        status, d, _ = await e.call("POST", "/v1/kvgate/decide", other, base=e.admin_url)
        assert all(c["hit_blocks"] == 0 for c in d["candidates"])
