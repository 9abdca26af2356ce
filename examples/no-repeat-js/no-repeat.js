// Example logits processor in JavaScript (componentize-js): bans the row's previous token, so
// the same token never appears twice in a row. Resources of mlxhost:plugin/tensors arrive as
// objects with their WIT methods (camelCase); the export is the `logits-processor` interface.

class Session {
  // `create: static func(params) -> result<session, plugin-error>`: return = ok, throw = error.
  static create(_params) {
    return new Session();
  }

  // `process(logits, history, step) -> result<_, plugin-error>`
  process(logits, history, _step) {
    const n = history.len();
    if (n > 0) {
      logits.ban(history.read(n - 1, n));
    }
  }

  accept(_token, _rawLogprob, _sampledLogprob) {}
}

export const logitsProcessor = { Session };
