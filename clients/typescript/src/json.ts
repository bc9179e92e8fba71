/**
 * `JSON.stringify` for the messages this package hands out. protobuf-es represents 64-bit
 * integers (`int64` fields, a `Timestamp`'s or `Duration`'s seconds) as `bigint`, on which
 * `JSON.stringify` throws, and `bytes` as a `Uint8Array`, which it writes as an object of
 * indexes. {@link jsonable} gives a message, and every message inside it, a non-enumerable
 * `toJSON` that writes the proto3 JSON mapping (protobuf-es `toJson`): 64-bit integers as
 * decimal strings, bytes as base64, timestamps as RFC 3339 strings, enums by name. What it
 * writes reads back with `fromJson(Schema, JSON.parse(text))`.
 *
 * ```ts
 * const { todo } = await sb.dispatch.getTodo({ todoId });
 * console.log(JSON.stringify(todo)); // {"id":"...","createdAt":"2026-01-02T03:04:05Z",...}
 * const again = fromJson(TodoSchema, JSON.parse(JSON.stringify(todo))); // equals(TodoSchema, again, todo)
 * ```
 */
import { toJson, type DescMessage, type Message, type MessageShape } from "@bufbuild/protobuf";
import type { Interceptor } from "@connectrpc/connect";

/**
 * Gives `message` and the messages in its fields (nested, in lists, in maps, in oneofs) a
 * `toJSON` that writes the proto3 JSON mapping; returns `message`. The property is not
 * enumerable, so spreads, `deepStrictEqual`, `equals` and `toBinary` do not see it. A
 * message that has one already is left as it is.
 */
export function jsonable<Desc extends DescMessage>(schema: Desc, message: MessageShape<Desc>): MessageShape<Desc> {
  walk(schema, message);
  return message;
}

function walk(schema: DescMessage, message: Message): void {
  if (Object.prototype.hasOwnProperty.call(message, "toJSON")) return;
  Object.defineProperty(message, "toJSON", {
    value: () => toJson(schema, message),
    enumerable: false,
    configurable: true,
    writable: true,
  });
  const fields = message as unknown as Record<string, unknown>;
  for (const member of schema.members) {
    if (member.kind === "oneof") {
      const chosen = fields[member.localName] as { case?: string; value?: unknown } | undefined;
      const field = member.fields.find((f) => f.localName === chosen?.case);
      if (field?.fieldKind === "message" && chosen?.value) walk(field.message, chosen.value as Message);
      continue;
    }
    const value = fields[member.localName];
    if (value === undefined || value === null) continue;
    if (member.fieldKind === "message") walk(member.message, value as Message);
    else if (member.fieldKind === "list" && member.listKind === "message") {
      for (const item of value as Message[]) walk(member.message, item);
    } else if (member.fieldKind === "map" && member.mapKind === "message") {
      for (const item of Object.values(value as Record<string, Message>)) walk(member.message, item);
    }
  }
}

/**
 * An interceptor that makes every message a call answers with {@link jsonable} (streams
 * too): {@link createTransport} puts it on every transport it makes.
 */
export const jsonResponses: Interceptor = (next) => async (request) => {
  const response = await next(request);
  const schema = response.method.output;
  if (!response.stream) {
    jsonable(schema, response.message);
    return response;
  }
  const messages = response.message;
  return {
    ...response,
    message: (async function* () {
      for await (const message of messages) yield jsonable(schema, message);
    })(),
  };
};
