"""What the proxy asks of a prefill instance, and the CLI's checks of --kv-transfer-config."""

from __future__ import annotations

import argparse

import pytest

from kdaserve.entrypoints.disagg_proxy import prefill_body
from kdaserve.entrypoints.openai.cli_args import kv_transfer_config


def test_prefill_body():
    body = {"model": "m", "messages": [], "stream": True, "stream_options": {"x": 1},
            "max_completion_tokens": 50, "min_tokens": 3, "temperature": 0.7}
    out = prefill_body(body)
    assert out == {"model": "m", "messages": [], "stream": False, "max_tokens": 1,
                   "min_tokens": 1, "temperature": 0.7,
                   "kv_transfer_params": {"do_remote_decode": True}}
    assert body["stream"] is True and "stream_options" in body     # the client's is kept


@pytest.mark.parametrize("value, match", [
    ("{nope", "not valid JSON"),
    ('["NixlConnector"]', "expected a JSON object"),
    ('{"kv_connector": "Mooncake", "kv_role": "kv_both"}', "kv_connector must be one of"),
    ('{"kv_connector": "NixlConnector", "kv_role": "prefill"}', "kv_role must be one of"),
    ('{"kv_connector": "NixlConnector"}', "needs 'kv_role'"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_port": 70000}', "kv_port"),
])
def test_kv_transfer_config_flag_errors(value, match):
    with pytest.raises(argparse.ArgumentTypeError, match=match):
        kv_transfer_config(value)


def test_kv_transfer_config_flag_ok():
    cfg = kv_transfer_config('{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}')
    assert cfg == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
