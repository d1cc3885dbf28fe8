"""What went wrong talking to the Hub, said as an hf_scale error that tells what to do.

huggingface_hub raises its HTTP errors (``HfHubHTTPError`` with the status and the server's
message) and httpx2 network errors, often wrapped (``RuntimeError("Error while uploading ...")``
from the real cause). :func:`hub_errors` walks that chain and raises HfScaleConfigError /
HfScaleHubError naming the Hub's URL, where that URL came from (``HF_ENDPOINT`` or the default)
and the fix; :func:`is_transient` says which failures are worth retrying. The token is masked
out of every message.

Usage::

    with hub_errors(api.endpoint, repo_id, token):
        api.create_repo(repo_id, exist_ok=True)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import httpx2
from huggingface_hub import get_token
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

from ..errors import HfScaleConfigError, HfScaleError, HfScaleHubError

RETRIED_NETWORK_ERRORS = (httpx2.RemoteProtocolError, httpx2.ReadError, httpx2.WriteError,
                          httpx2.ReadTimeout, httpx2.WriteTimeout, httpx2.PoolTimeout)
UNREACHABLE_ERRORS = (httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.ProxyError)
RESUME_HINT = " Files already committed stay on the Hub: push again to send only what is missing."


def resolve_token(token: str | None) -> str:
    token = token or get_token()
    if not token:
        raise HfScaleConfigError(
            "no Hugging Face token found: set HF_TOKEN to a token with write access "
            "(https://huggingface.co/settings/tokens) or run `hf auth login`."
        )
    return token


def mask(text: str, secret: str | None) -> str:
    return text.replace(secret, "***") if secret else text


def causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from, outermost first."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_transient(exc: BaseException) -> bool:
    """True for 5xx / 408 / 429 answers and connections dropped mid-request."""
    for e in causes(exc):
        if isinstance(e, HfHubHTTPError):
            status = e.response.status_code
            return status >= 500 or status in (408, 429)
        if isinstance(e, RETRIED_NETWORK_ERRORS):
            return True
    return False


def endpoint_source() -> str:
    if os.environ.get("HF_ENDPOINT"):
        return "set by HF_ENDPOINT"
    return "the default; set HF_ENDPOINT to use another Hub"


@contextlib.contextmanager
def hub_errors(endpoint: str, repo_id: str, token: str) -> Iterator[None]:
    """Turn huggingface_hub / network errors into HfScale errors that say what to do."""
    try:
        yield
    except HfScaleError:
        raise
    except Exception as e:
        error = translate(e, endpoint, repo_id)
        if error is None:
            raise
        raise type(error)(mask(str(error), token)) from e


def translate(exc: BaseException, endpoint: str, repo_id: str) -> HfScaleError | None:
    where = f"the Hub at {endpoint} ({endpoint_source()})"
    for e in causes(exc):
        if isinstance(e, OfflineModeIsEnabled):
            return HfScaleConfigError(f"cannot push to {endpoint}: HF_HUB_OFFLINE is set. Unset it to push.")
        if isinstance(e, UNREACHABLE_ERRORS):
            return HfScaleHubError(f"cannot reach {where}: {type(e).__name__}: {e}. Check the address and "
                                   "the network, or set HF_ENDPOINT to a reachable Hub.")
        if isinstance(e, HfHubHTTPError):
            return http_error(e, where, repo_id)
        if isinstance(e, httpx2.TransportError):
            return HfScaleHubError(f"lost the connection to {where} while pushing {repo_id}: "
                                   f"{type(e).__name__}: {e}.{RESUME_HINT}")
    return None


def http_error(e: HfHubHTTPError, where: str, repo_id: str) -> HfScaleHubError:
    status = e.response.status_code
    said = " ".join((e.server_message or str(e).splitlines()[0]).split())
    request = f"{e.response.request.method} {str(e.response.request.url).split('?')[0]}"
    if status == 401:
        return HfScaleHubError(f"{where} refused the token for {repo_id} (401 Unauthorized: {said}). "
                               "Set HF_TOKEN to a valid token with write access, or run `hf auth login`.")
    if status == 403:
        return HfScaleHubError(f"{where} refused {request} for {repo_id} (403 Forbidden: {said}). Check that "
                               f"the token may write to that namespace.{RESUME_HINT}")
    return HfScaleHubError(f"{where} answered {status} to {request} while pushing {repo_id}: "
                           f"{said}.{RESUME_HINT}")
