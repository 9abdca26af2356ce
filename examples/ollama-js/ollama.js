// Example API adapter in JavaScript (componentize-js, WIT mlxhost:plugin@0.2.0): a subset of
// Ollama's chat API, `POST /api/chat` and `GET /api/tags`, over the host's HTTP.
//
// WIT values in JavaScript: records are objects with camelCase fields, variants are
// `{tag, val}`, enums are strings, options are a value or `undefined`, `list<u8>` is a
// Uint8Array and `u64` a BigInt. The host creates one instance per request, so nothing needs
// to be kept between `handle` and `render`.
//
// Replies are never streamed: Ollama streams newline-delimited JSON, and the host frames
// streams as server-sent events, so `"stream": true` (Ollama's default) is answered whole.

const encoder = new TextEncoder();
const decoder = new TextDecoder();

function json(status, body) {
  return { status, contentType: "application/json", body: encoder.encode(JSON.stringify(body)) };
}

function error(status, message) {
  return json(status, { error: message });
}

// Unix seconds -> RFC 3339, as Ollama's `created_at`.
function timestamp(seconds) {
  return new Date(Number(seconds) * 1000).toISOString();
}

function text(content) {
  return [{ tag: "text", val: content }];
}

// Ollama messages -> canonical messages. Throws a message naming the field.
function messages(list) {
  if (!Array.isArray(list) || list.length === 0) throw "messages: must be a non-empty array";
  return list.map((m, i) => {
    if (typeof m !== "object" || m === null) throw `messages[${i}]: must be an object`;
    if (!["system", "user", "assistant", "tool"].includes(m.role))
      throw `messages[${i}].role: must be system, user, assistant or tool`;
    if (typeof m.content !== "string") throw `messages[${i}].content: must be a string`;
    if (m.images) throw `messages[${i}].images: this model takes text only`;
    const calls = (m.tool_calls || []).map((c, k) => ({
      id: `call_${i}_${k}`,
      name: String(c.function && c.function.name),
      arguments: JSON.stringify((c.function && c.function.arguments) || {}),
    }));
    return {
      role: m.role,
      content: text(m.content),
      name: undefined,
      toolCalls: calls,
      toolCallId: undefined,
      reasoning: m.thinking || undefined,
    };
  });
}

function number(options, key) {
  const v = options[key];
  if (v === undefined || v === null) return undefined;
  if (typeof v !== "number") throw `options.${key}: must be a number`;
  return v;
}

function chat(body) {
  const req = JSON.parse(decoder.decode(body));
  const options = req.options || {};
  const tools = (req.tools || []).map((t, i) => {
    const f = t.function || {};
    if (typeof f.name !== "string") throw `tools[${i}].function.name: must be a string`;
    return { name: f.name, parametersJson: JSON.stringify(f.parameters || {}), description: f.description || "" };
  });
  const numPredict = number(options, "num_predict");
  const seed = number(options, "seed");
  const topK = number(options, "top_k");
  return {
    prompt: { tag: "messages", val: messages(req.messages) },
    sampling: {
      temperature: number(options, "temperature"),
      topP: number(options, "top_p"),
      topK: topK === undefined ? undefined : topK,
      minP: number(options, "min_p"),
      xtcProbability: undefined,
      xtcThreshold: undefined,
      seed: seed === undefined ? undefined : BigInt(seed),
      repetitionPenalty: number(options, "repeat_penalty"),
      repetitionContextSize: number(options, "repeat_last_n"),
      presencePenalty: number(options, "presence_penalty"),
      frequencyPenalty: number(options, "frequency_penalty"),
      logitBias: [],
    },
    maxTokens: numPredict === undefined || numPredict < 0 ? undefined : numPredict,
    clampMaxTokens: true,
    stop: Array.isArray(options.stop) ? options.stop.map(String) : [],
    stream: false,
    logprobs: false,
    topLogprobs: 0,
    tools,
    toolChoice: tools.length ? { tag: "auto" } : { tag: "none" },
    parallelToolCalls: true,
    toolParser: undefined,
    reasoningParser: undefined,
    chatTemplateKwargs: "{}",
    sampler: req.sampler,
    logitsProcessors: [],
    pluginParams: JSON.stringify(req.plugin_params || {}),
    includeUsage: true,
    previousResponseId: undefined,
  };
}

export const apiAdapter = {
  routes() {
    return [
      { method: "POST", path: "/api/chat" },
      { method: "GET", path: "/api/tags" },
    ];
  },

  handle(ctx, request) {
    if (request.method === "GET") {
      const model = { name: ctx.modelId, model: ctx.modelId, modified_at: timestamp(ctx.created) };
      return { tag: "respond", val: json(200, { models: [model] }) };
    }
    try {
      return { tag: "generate", val: chat(request.body) };
    } catch (e) {
      return { tag: "respond", val: error(400, e instanceof Error ? e.message : String(e)) };
    }
  },

  render(ctx, update) {
    let content = "";
    let thinking = "";
    const calls = new Map();
    for (const e of update.events) {
      if (e.tag === "text" || e.tag === "invalid-call") content += e.val;
      else if (e.tag === "reasoning") thinking += e.val;
      else if (e.tag === "tool-call-start") calls.set(e.val.index, { name: e.val.name, arguments: "" });
      else if (e.tag === "tool-call-arguments-delta") calls.get(e.val.index).arguments += e.val.arguments;
    }
    const message = { role: "assistant", content };
    if (thinking) message.thinking = thinking;
    if (calls.size)
      message.tool_calls = [...calls.values()].map((c) => ({
        function: { name: c.name, arguments: JSON.parse(c.arguments || "{}") },
      }));
    const usage = update.usage || { promptTokens: 0, completionTokens: 0 };
    return json(200, {
      model: ctx.modelId,
      created_at: timestamp(ctx.created),
      message,
      done: true,
      done_reason: update.finish === "length" ? "length" : "stop",
      prompt_eval_count: usage.promptTokens,
      eval_count: usage.completionTokens,
    });
  },

  renderStream(_ctx, _update) {
    return [];
  },

  renderError(_ctx, err) {
    return error(err.status, err.message);
  },

  renderStreamError(_ctx, err) {
    return [{ event: "", data: JSON.stringify({ error: err.message }) }];
  },
};
