"""Tenants in the API process: whom a request is served for, and what each tenant has queued.

Owns three things:

* ``resolve``: a request's tenant is the name of the API key it came with (``--api-key NAME=KEY``),
  else its ``x-lockgate-tenant`` header, else its ``user`` field (OpenAI routes), else ``default``.
  A key's name cannot be overridden by the header or the field; a header or field longer than
  ``MAX_TENANT_CHARS`` is a 400 naming it. The tenant travels with the request to the scheduler,
  whose fair share (``--fairness vtc``) is per tenant, and names it in the per-tenant metrics.
* ``label``: the metrics label of a tenant, with bounded cardinality: tenants named by keys or
  ``--tenant-weight`` always have their own label, the first ``MAX_OTHER_LABELS`` others seen too,
  every later one is ``other``.
* the per-tenant queue limit (``--max-queued-per-tenant``): a tenant with that many requests
  accepted and still waiting for their first token gets 429 with Retry-After; other tenants are
  not affected (the server-wide ``--max-queued-requests`` still applies to all).

Counting is over the engine client's live streams (``RequestStream.tenant``), so there is no
separate count to drift.
"""

from __future__ import annotations

from collections.abc import Iterable

DEFAULT_TENANT = "default"
TENANT_HEADER = "x-lockgate-tenant"
MAX_TENANT_CHARS = 256
MAX_OTHER_LABELS = 32
OTHER = "other"


class TenantError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class Tenants:
    def __init__(self, known: Iterable[str] = ()) -> None:
        self.known = {t for t in known if t}
        self.known.add(DEFAULT_TENANT)
        self._others: set[str] = set()

    def resolve(self, key_name: str | None, header: str | None, user: str | None) -> str:
        """The tenant of a request (see the module docstring); TenantError for a name too long."""
        if key_name:
            return key_name
        for value, param in ((header, TENANT_HEADER), (user, "user")):
            if value is None:
                continue
            value = value.strip()
            if len(value) > MAX_TENANT_CHARS:
                raise TenantError(f"{param} is {len(value)} characters; a tenant name has at most "
                                  f"{MAX_TENANT_CHARS}", param)
            if value:
                return value
        return DEFAULT_TENANT

    def labels(self) -> set[str]:
        """Every label given so far, and the known tenants'."""
        return self.known | self._others

    def label(self, tenant: str) -> str:
        """The metrics label of ``tenant`` (bounded cardinality)."""
        if tenant in self.known or tenant in self._others:
            return tenant
        if len(self._others) < MAX_OTHER_LABELS:
            self._others.add(tenant)
            return tenant
        return OTHER
