"""The NIXL connector: a decode instance pulls (READ) a request's MLA KV blocks and KDA state
from the prefill instance that computed its prompt."""
