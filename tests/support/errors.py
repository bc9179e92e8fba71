"""Reading gRPC errors in tests: codes and the richer error model (google.rpc.Status details)."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Iterable
from typing import TYPE_CHECKING, cast

import grpc
from google.protobuf import descriptor
from google.rpc import code_pb2, error_details_pb2, status_pb2
from switchboard_dispatch.v1 import admission_pb2

if TYPE_CHECKING:
    from google._upb import _message as upb

    #: A message type's descriptor, as ``Message.DESCRIPTOR`` gives it.
    MessageDescriptor = descriptor.Descriptor | upb.Descriptor

_DETAILS_KEY = "grpc-status-details-bin"


def _details_bin(err: grpc.aio.AioRpcError) -> bytes | None:
    """The raw ``grpc-status-details-bin`` trailer of an error, or None when it has none."""
    # grpc.aio yields (key, value) pairs; the stubs type them as _Metadatum.
    trailers = cast(Iterable[tuple[str, str | bytes]], err.trailing_metadata() or ())
    for key, value in trailers:
        if key == _DETAILS_KEY:
            assert isinstance(value, bytes)
            return value
    return None


def rich_status(err: grpc.aio.AioRpcError) -> status_pb2.Status:
    """The google.rpc.Status carried in the ``grpc-status-details-bin`` trailer."""
    raw = _details_bin(err)
    if raw is None:
        raise AssertionError(f"no {_DETAILS_KEY} in {err.trailing_metadata()!r}")
    return status_pb2.Status.FromString(raw)


def status_of(err: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str | None, bytes | None]:
    """Everything a caller can observe of an error: code, message and rich details."""
    return err.code(), err.details(), _details_bin(err)


async def expect_code(call: Awaitable[object], code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    """Awaits a call that must fail with ``code``; returns the error.

    The error must also carry a google.rpc.Status with the same code.
    """
    try:
        await call
    except grpc.aio.AioRpcError as err:
        assert err.code() == code, (err.code(), err.details())
        status = rich_status(err)
        assert status.code == code.value[0]
        return err
    raise AssertionError(f"expected {code}, the call succeeded")


def violations(err: grpc.aio.AioRpcError) -> dict[str, str]:
    """field -> description of the BadRequest detail of an INVALID_ARGUMENT error.

    Also checks that the rich status repeats the error's code and message, and that
    each field is reported once and with a description.
    """
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    status = rich_status(err)
    assert status.code == code_pb2.INVALID_ARGUMENT
    assert status.message == err.details()
    found: dict[str, str] = {}
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            assert detail.Unpack(bad)
            for v in bad.field_violations:
                assert v.field not in found, f"{v.field} reported twice"
                assert v.description, f"{v.field} has no description"
                found[v.field] = v.description
    assert found, f"no BadRequest field violations in {status}"
    return found


_SEGMENT = re.compile(r"([a-z_][a-z0-9_]*)(?:\[(\d+)\])?")


def field_path_resolves(message: MessageDescriptor, path: str) -> bool:
    """Whether ``path`` (``todos[3].queue.endpoint_id``) names a field of
    ``message``: each segment a field of the message before it, an index only
    on (and then through) a repeated field; the last segment may also name a
    oneof (``settlements[2].action``: the action that is missing)."""
    segments = path.split(".")
    for n, segment in enumerate(segments):
        match = _SEGMENT.fullmatch(segment)
        if match is None:
            return False
        name, index = match.groups()
        last = n == len(segments) - 1
        field = message.fields_by_name.get(name)
        if field is None:
            return last and index is None and name in message.oneofs_by_name
        repeated = field.is_repeated
        if index is not None and not repeated:
            return False
        if last:
            return True
        if field.message_type is None or (repeated and index is None):
            return False
        message = field.message_type
    return False


def field_violations(err: grpc.aio.AioRpcError) -> list[str]:
    """The fields of every BadRequest detail of an error, whatever its code."""
    fields: list[str] = []
    for detail in rich_status(err).details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            assert detail.Unpack(bad)
            fields.extend(v.field for v in bad.field_violations)
    return fields


def has_retry_info(err: grpc.aio.AioRpcError) -> bool:
    """Whether the error's rich status carries a RetryInfo detail."""
    return any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in rich_status(err).details)


class Deferred:
    """The unpacked details of a deferred Claim.

    Checks that the error is RESOURCE_EXHAUSTED with exactly one ErrorInfo
    (reason DEFERRED, domain switchboard), exactly one DeferralDetail and at
    most one RetryInfo.
    """

    def __init__(self, err: grpc.aio.AioRpcError) -> None:
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (err.code(), err.details())
        status = rich_status(err)
        assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        self.infos: list[error_details_pb2.ErrorInfo] = []
        self.details: list[admission_pb2.DeferralDetail] = []
        self.retries: list[error_details_pb2.RetryInfo] = []
        for any_detail in status.details:
            if any_detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                assert any_detail.Unpack(info)
                self.infos.append(info)
            elif any_detail.Is(admission_pb2.DeferralDetail.DESCRIPTOR):
                detail = admission_pb2.DeferralDetail()
                assert any_detail.Unpack(detail)
                self.details.append(detail)
            elif any_detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                retry = error_details_pb2.RetryInfo()
                assert any_detail.Unpack(retry)
                self.retries.append(retry)
        assert [(i.reason, i.domain) for i in self.infos] == [("DEFERRED", "switchboard")]
        assert len(self.details) == 1, status
        assert len(self.retries) <= 1

    @property
    def detail(self) -> admission_pb2.DeferralDetail:
        """The DeferralDetail."""
        return self.details[0]

    @property
    def retry(self) -> error_details_pb2.RetryInfo | None:
        """The RetryInfo, when the deferral has an exact end."""
        return self.retries[0] if self.retries else None


def deferral_of(err: grpc.aio.AioRpcError) -> admission_pb2.DeferralDetail:
    """The DeferralDetail of a deferred Claim.

    Checks everything :class:`Deferred` does, and that the ErrorInfo comes first
    and the DeferralDetail second.
    """
    deferred = Deferred(err)
    first, second = rich_status(err).details[:2]
    assert first.Is(error_details_pb2.ErrorInfo.DESCRIPTOR), first
    assert second.Is(admission_pb2.DeferralDetail.DESCRIPTOR), second
    return deferred.detail
