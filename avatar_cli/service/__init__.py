"""Heavy, rarely-changing parts of a render served to a fleet: `avatar serve text` (text_server.py)
and the client a render asks behind its text cache (text_client.py).

Both need the optional extra `avatar-cli[service]` (FastAPI + uvicorn for the server, httpx for the client);
nothing here is imported unless a job names a service or `avatar serve` runs.
"""

SCHEMA = "avatar-text/1"  # the request and health schema; a change that old clients cannot read bumps it
TOKEN_ENV = "AVATAR_TEXT_TOKEN"  # the bearer token, on both sides
INSTALL_HINT = "pip install 'avatar-cli[service]'"
