"""Server reflection (``grpc.reflection.v1alpha``) that keeps the proto comments.

grpcio-reflection answers with descriptors re-serialized from a ``DescriptorPool``, and the
protobuf runtime drops ``source_code_info`` on the way, so ``grpcurl describe`` would show
no comments. This servicer answers with the ``FileDescriptorProto``s that protoc wrote, with
their source info, into ``api_descriptors.binpb`` (by ``scripts/generate-docs``). Files not in
that set (health, reflection, and the google.rpc error details that grpcurl decodes in error
statuses) are served from their compiled-in descriptors, without comments.

Symbols are indexed from the files themselves, methods included: a ``DescriptorPool`` cannot
find ``switchboard.v1.DispatchService.ClaimNext``, the symbol ``grpcurl describe`` asks for.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from importlib import resources
from typing import Any, TypeAlias

import grpc
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FileDescriptor
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

SERVICE_NAME = "grpc.reflection.v1alpha.ServerReflection"
DESCRIPTORS = "api_descriptors.binpb"


def load_descriptor_set() -> descriptor_pb2.FileDescriptorSet:
    """The API's descriptor set shipped in this package (dependencies first), as served.

    protoc fills every field's ``json_name`` in a descriptor set, while the compiled modules
    (and so the server's reflection before comments) leave it out; with it, grpcurl would
    print ``leaseId`` where it prints ``lease_id`` today. So it is cleared here, and the set
    is the compiled API plus its comments.
    """
    data = resources.files("switchboard_server").joinpath(DESCRIPTORS).read_bytes()
    descriptor_set = descriptor_pb2.FileDescriptorSet.FromString(data)
    for file in descriptor_set.file:
        for extension in _extensions(file):
            extension.ClearField("json_name")
        for message in _messages(file.message_type):
            for fld in message.field:
                fld.ClearField("json_name")
    return descriptor_set


def compiled_files(*files: FileDescriptor) -> list[descriptor_pb2.FileDescriptorProto]:
    """Compiled-in files and, after each, what it imports (transitively, once each)."""
    seen: dict[str, descriptor_pb2.FileDescriptorProto] = {}

    def add(file: FileDescriptor) -> None:
        if file.name not in seen:
            seen[file.name] = descriptor_pb2.FileDescriptorProto()
            file.CopyToProto(seen[file.name])
            for dependency in file.dependencies:
                add(dependency)

    for file in files:
        add(file)
    return list(seen.values())


class ReflectionServicer:
    """Answers reflection requests from serialized files, comments included."""

    def __init__(
        self, service_names: Iterable[str], files: Iterable[descriptor_pb2.FileDescriptorProto]
    ) -> None:
        self._service_names = sorted(service_names)
        self._files: dict[str, descriptor_pb2.FileDescriptorProto] = {}
        self._symbols: dict[str, str] = {}  # fully qualified name -> file name
        self._extensions: dict[str, dict[int, str]] = {}  # extendee -> number -> file name
        for file in files:
            if file.name in self._files:
                continue
            self._files[file.name] = file
            for symbol in _symbols(file):
                self._symbols.setdefault(symbol, file.name)
            for extension in _extensions(file):
                extendee = extension.extendee.lstrip(".")
                self._extensions.setdefault(extendee, {})[extension.number] = file.name

    async def ServerReflectionInfo(
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        """One response per request, in order (the v1alpha protocol)."""
        async for request in requests:
            yield self.answer(request)

    def answer(self, request: Any) -> Any:
        """The response to one ``ServerReflectionRequest``."""
        kind = request.WhichOneof("message_request")
        try:
            if kind == "list_services":
                return reflection_pb2.ServerReflectionResponse(
                    original_request=request,
                    list_services_response=reflection_pb2.ListServiceResponse(
                        service=[
                            reflection_pb2.ServiceResponse(name=name)
                            for name in self._service_names
                        ]
                    ),
                )
            if kind == "file_by_filename":
                return self._file_response(request, request.file_by_filename)
            if kind == "file_containing_symbol":
                symbol = request.file_containing_symbol
                return self._file_response(request, self._symbols[symbol])
            if kind == "file_containing_extension":
                ask = request.file_containing_extension
                name = self._extensions[ask.containing_type][ask.extension_number]
                return self._file_response(request, name)
            if kind == "all_extension_numbers_of_type":
                extendee = request.all_extension_numbers_of_type
                if extendee not in self._symbols:
                    raise KeyError(extendee)
                return reflection_pb2.ServerReflectionResponse(
                    original_request=request,
                    all_extension_numbers_response=reflection_pb2.ExtensionNumberResponse(
                        base_type_name=extendee,
                        extension_number=sorted(self._extensions.get(extendee, {})),
                    ),
                )
        except KeyError:
            return _error(request, grpc.StatusCode.NOT_FOUND)
        return _error(request, grpc.StatusCode.INVALID_ARGUMENT)

    def _file_response(self, request: Any, name: str) -> Any:
        """The file and every file it imports, transitively (the protocol's contract)."""
        if name not in self._files:
            raise KeyError(name)
        order: list[str] = []
        pending = [name]
        while pending:
            current = pending.pop()
            if current not in order:
                order.append(current)
                pending.extend(reversed(self._files[current].dependency))
        return reflection_pb2.ServerReflectionResponse(
            original_request=request,
            file_descriptor_response=reflection_pb2.FileDescriptorResponse(
                file_descriptor_proto=[self._files[n].SerializeToString() for n in order]
            ),
        )


def _symbols(file: descriptor_pb2.FileDescriptorProto) -> Iterator[str]:
    """Every fully qualified name a file declares, scoped like protoc does."""

    def join(scope: str, name: str) -> str:
        return f"{scope}.{name}" if scope else name

    def enum(scope: str, declared: descriptor_pb2.EnumDescriptorProto) -> Iterator[str]:
        yield join(scope, declared.name)
        # Enum values are siblings of their enum, not its children.
        yield from (join(scope, value.name) for value in declared.value)

    def message(scope: str, declared: descriptor_pb2.DescriptorProto) -> Iterator[str]:
        name = join(scope, declared.name)
        yield name
        yield from (join(name, field.name) for field in (*declared.field, *declared.extension))
        yield from (join(name, oneof.name) for oneof in declared.oneof_decl)
        for nested in declared.nested_type:
            yield from message(name, nested)
        for nested_enum in declared.enum_type:
            yield from enum(name, nested_enum)

    package = file.package
    for declared in file.message_type:
        yield from message(package, declared)
    for declared_enum in file.enum_type:
        yield from enum(package, declared_enum)
    for extension in file.extension:
        yield join(package, extension.name)
    for service in file.service:
        name = join(package, service.name)
        yield name
        yield from (join(name, method.name) for method in service.method)


Field: TypeAlias = descriptor_pb2.FieldDescriptorProto


def _extensions(file: descriptor_pb2.FileDescriptorProto) -> Iterator[Field]:
    """Every extension a file declares, at top level or inside messages."""

    def nested(declared: descriptor_pb2.DescriptorProto) -> Iterator[Field]:
        yield from declared.extension
        for inner in declared.nested_type:
            yield from nested(inner)

    yield from file.extension
    for declared in file.message_type:
        yield from nested(declared)


def _messages(
    messages: Iterable[descriptor_pb2.DescriptorProto],
) -> Iterator[descriptor_pb2.DescriptorProto]:
    for message in messages:
        yield message
        yield from _messages(message.nested_type)


def _error(request: Any, code: grpc.StatusCode) -> Any:
    number, message = code.value
    return reflection_pb2.ServerReflectionResponse(
        original_request=request,
        error_response=reflection_pb2.ErrorResponse(error_code=number, error_message=message),
    )


def enable_server_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Adds reflection for ``service_names`` (which should include ``SERVICE_NAME``)."""
    files = [
        *load_descriptor_set().file,
        *compiled_files(
            health_pb2.DESCRIPTOR,
            reflection_pb2.DESCRIPTOR,
            error_details_pb2.DESCRIPTOR,
            status_pb2.DESCRIPTOR,
        ),
    ]
    servicer = ReflectionServicer(service_names, files)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, {"ServerReflectionInfo": handler}),)
    )
