"""Drives SkyRL's own ``RemoteInferenceClient`` (skyrl 0.3.0, .venv-skyrl) against a BubbleSpec
scheduler; run by tests/integration/test_skyrl_client.py as
``.venv-skyrl/bin/python tests/support/skyrl_driver.py '{"url": ..., "scenario": ...}'``.

It prints one JSON line: what each client call returned (or the HTTP error it raised). It does
not import BubbleSpec (not installed in that venv); the test checks the scheduler's side.

skyrl 0.3.0 does not import on Python 3.11 as released: ``skyrl/tinker/types.py`` (imported by
``skyrl.backends``) puts a ``typing.TypedDict`` in a pydantic model, which pydantic refuses below
Python 3.12. Before importing skyrl this script makes ``typing.TypedDict`` the
``typing_extensions`` one (what pydantic asks for); SkyRL's code runs unchanged.
"""

from __future__ import annotations

import asyncio
import json
import sys
import typing

import typing_extensions

typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]  # see the module docstring

import aiohttp  # noqa: E402
from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient  # noqa: E402


def _error(exc: aiohttp.ClientResponseError) -> dict:
    return {"status": exc.status, "message": exc.message}


async def _bodies(results: dict) -> list:
    """``_call_all_servers``' answer -> the bodies, in server order."""
    return [r["body"] for r in results.values()]


async def serve(client: RemoteInferenceClient, plan: dict) -> dict:
    """Data plane, pause/resume and sleep/wake_up, as SkyRL's generator and trainer call them."""
    out: dict = {"world_size": list(await client.get_world_size())}
    greedy = {"temperature": 0.0, "max_tokens": 8}
    gen = await client.generate({"prompt_token_ids": plan["prompts"], "sampling_params": greedy})
    out["generate"] = {k: gen[k] for k in ("responses", "response_ids", "stop_reasons")}
    out["completion"] = await client.completion({"json": {"prompt": plan["prompts"][0], **greedy}})
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    out["chat"] = await client.chat_completion({"json": {"messages": messages, **greedy}})
    out["render"] = await client.render_chat_completion({"json": {"messages": messages, **greedy}})
    out["tokenize"] = await client.tokenize(["hello world"])
    out["detokenize"] = await client.detokenize(out["tokenize"])

    # pause(keep) while a generation runs: it goes on after resume (SkyRL's default pause mode)
    running = asyncio.create_task(client.generate({"prompt_token_ids": plan["prompts"][:1],
                                                   "sampling_params": {"temperature": 0.0, "max_tokens": 48}}))
    await asyncio.sleep(plan.get("pause_after", 0.3))
    out["pause"] = await _bodies(await client.pause(mode="keep"))
    out["is_paused"] = await _bodies(await client._call_all_servers("/is_paused", method="GET"))
    out["resume"] = await _bodies(await client.resume())
    kept = await running
    out["kept"] = {"response_ids": kept["response_ids"], "stop_reasons": kept["stop_reasons"]}

    # sleep (SkyRL's colocated loop: sleep -> train -> wake weights -> sync -> wake kv_cache)
    out["sleep"] = await _bodies(await client.sleep(level=1))
    out["is_sleeping"] = await _bodies(await client._call_all_servers("/is_sleeping", method="GET"))
    try:
        await client.resume()
    except aiohttp.ClientResponseError as exc:
        out["resume_while_asleep"] = _error(exc)
    waiting = asyncio.create_task(client.generate({"prompt_token_ids": plan["prompts"][:1], "sampling_params": greedy}))
    await asyncio.sleep(1.0)
    out["ran_while_asleep"] = waiting.done()
    out["wake_weights"] = await _bodies(await client.wake_up(tags=["weights"]))
    await asyncio.sleep(0.5)
    out["ran_after_weights"] = waiting.done()
    out["wake_kv_cache"] = await _bodies(await client.wake_up(tags=["kv_cache"]))
    after = await asyncio.wait_for(waiting, 60)
    out["after_wake"] = after["response_ids"]
    out["is_sleeping_after"] = await _bodies(await client._call_all_servers("/is_sleeping", method="GET"))
    out["reset_prefix_cache"] = await _bodies(await client.reset_prefix_cache())
    return out


async def init(client: RemoteInferenceClient, plan: dict) -> list:
    """The group, as ``init_weight_update_communicator`` sets it up: the servers' world size, the
    trainer as rank 0 (``BroadcastTransferStrategy.create_init_info``: world size + 1), each
    server's ``BroadcastInitInfo.to_api_payload()`` posted to /init_weight_transfer_engine.
    ``BroadcastInitInfo`` itself needs ray and torch, which this venv does not have; its payload's
    fields are written out here, with the client's own fan-out."""
    total, _ = await client.get_world_size()
    info = {"master_address": "127.0.0.1", "master_port": plan.get("master_port", 29551), "rank_offset": 1,
            "world_size": total + 1}
    return await _bodies(await client._call_all_servers("/init_weight_transfer_engine", {"init_info": info}))


async def sync(client: RemoteInferenceClient, plan: dict) -> dict:
    """SkyRL's weight sync as ``BroadcastWeightTransferSender._send_chunks_vllm_native`` calls the
    client (the NCCL broadcast itself is the trainer's and needs GPUs), inside a level-2 sleep."""
    out: dict = {"init": await init(client, plan)}
    out["sleep"] = await _bodies(await client.sleep(level=2))
    out["wake_weights"] = await _bodies(await client.wake_up(tags=["weights"]))
    out["start"] = await _bodies(await client.start_weight_update(is_checkpoint_format=True))
    out["update"] = await _bodies(await client.update_weights_nccl({**plan["metadata"], "packed": True}))
    out["finish"] = await _bodies(await client.finish_weight_update())
    client.increment_weight_version()
    out["wake_kv_cache"] = await _bodies(await client.wake_up(tags=["kv_cache"]))
    out["completion"] = await client.completion({"json": {"prompt": [5, 6, 7], "temperature": 0.0, "max_tokens": 4}})
    for name, call in (("ipc", client.update_weights_ipc({"names": ["w"]})),
                       ("kernel_format", client.start_weight_update(is_checkpoint_format=False))):
        try:
            await call
            out[name] = None
        except aiohttp.ClientResponseError as exc:
            out[name] = _error(exc)
    return out


async def start_and_hang(client: RemoteInferenceClient, plan: dict) -> dict:
    """A trainer that opens an update and dies before finishing it (the test kills this process)."""
    await init(client, plan)
    await client.start_weight_update(is_checkpoint_format=True)
    print(json.dumps({"started": True}), flush=True)
    await asyncio.sleep(3600)
    return {}


async def main() -> None:
    plan = json.loads(sys.argv[1])
    client = RemoteInferenceClient(proxy_url=plan["url"], server_urls=[plan["url"]], data_parallel_size=1,
                                   model_name=plan.get("model", "default"))
    try:
        out = await {"serve": serve, "sync": sync, "start_and_hang": start_and_hang}[plan["scenario"]](client, plan)
    finally:
        await client.teardown()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
