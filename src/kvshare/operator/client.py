"""The operator's writes to the Kubernetes API: create, patch and delete objects.

A thin layer over the ``kubernetes`` package's :class:`~kubernetes.client.ApiClient`:
objects go as plain dicts (rendered by :mod:`kvshare.operator.render`), responses come
back as parsed JSON, and failures as :class:`ApiError` with the API server's status. The
client is synchronous; each call runs in a worker thread so the event loop never blocks.
Reads never come through here: the operator reads from kopf's watch-fed indexes.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

from kvshare import __version__
from kvshare.api import names

if TYPE_CHECKING:
    from kubernetes.client import ApiClient, Configuration

__all__ = [
    "USER_AGENT",
    "ApiError",
    "KubeApi",
    "modelserver_status_path",
    "pods_path",
    "services_path",
]

log = logging.getLogger(__name__)

USER_AGENT = f"{names.MANAGED_BY}/{__version__}"
#: Seconds (connect, read) one API call may take.
_TIMEOUT = (5.0, 30.0)
_MERGE_PATCH = "application/merge-patch+json"


class ApiError(Exception):
    """The API server refused a request (or could not be reached: status 0)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        self.status = status
        self.reason = reason
        self.message = message
        super().__init__(f"{status} {reason}: {message}")

    @property
    def retriable(self) -> bool:
        """Whether the same request may succeed later without any change."""
        return self.status in {0, 429} or self.status >= 500


class KubeApi:
    """Create, merge-patch and delete objects by API path."""

    def __init__(self, configuration: Configuration) -> None:
        from kubernetes.client import ApiClient

        self._client: ApiClient = ApiClient(configuration)
        self._client.user_agent = USER_AGENT

    def close(self) -> None:
        """Release the connection pool."""
        self._client.close()  # type: ignore[no-untyped-call]

    def _call(self, method: str, path: str, body: object, content_type: str) -> dict[str, Any]:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        headers = {"Accept": "application/json", "Content-Type": content_type}
        try:
            request = self._client.param_serialize(
                method=method,
                resource_path=path,
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
            )
            response = self._client.call_api(*request, _request_timeout=_TIMEOUT)
            data = response.read()  # type: ignore[no-untyped-call]
        except (ApiException, HTTPError, OSError) as exc:
            raise ApiError(0, type(exc).__name__, str(exc)) from None
        parsed = json.loads(data) if data else {}
        if response.status >= 400:
            raise ApiError(
                response.status,
                str(parsed.get("reason") or response.reason or ""),
                str(parsed.get("message") or data[:200]),
            )
        return dict(parsed)

    async def _request(
        self, method: str, path: str, body: object = None, content_type: str = "application/json"
    ) -> dict[str, Any]:
        return await asyncio.to_thread(self._call, method, path, body, content_type)

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """POST ``body`` to collection ``path``; ``None`` when it exists already (409)."""
        try:
            return await self._request("POST", path, body)
        except ApiError as exc:
            if exc.status == 409:
                return None
            raise

    async def get(self, path: str) -> dict[str, Any] | None:
        """GET the object at ``path``; ``None`` when there is none (404)."""
        try:
            return await self._request("GET", path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any] | None:
        """JSON-merge-patch the object at ``path``; ``None`` when it is gone (404)."""
        try:
            return await self._request("PATCH", path, patch, _MERGE_PATCH)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def delete(self, path: str, uid: str | None = None) -> bool:
        """DELETE the object at ``path`` (only if it still has ``uid``); False if gone."""
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            await self._request("DELETE", path, body)
        except ApiError as exc:
            if exc.status in (404, 409):  # gone, or replaced by a newer object of that name
                return False
            raise
        return True


def pods_path(namespace: str, name: str | None = None) -> str:
    """API path of the pods of ``namespace``, or of one pod."""
    base = f"/api/v1/namespaces/{namespace}/pods"
    return f"{base}/{name}" if name else base


def services_path(namespace: str, name: str | None = None) -> str:
    """API path of the services of ``namespace``, or of one service."""
    base = f"/api/v1/namespaces/{namespace}/services"
    return f"{base}/{name}" if name else base


def modelserver_status_path(namespace: str, name: str) -> str:
    """API path of a ModelServer's status subresource."""
    return (
        f"/apis/{names.GROUP}/{names.VERSION}/namespaces/{namespace}/"
        f"{names.MODELSERVER_PLURAL}/{name}/status"
    )
