// What each button does on the server: send (create or continue a sequence, forking it when the message
// it continues from is not its tip), reply/regenerate (fork at the end of the user's message, generate),
// stop (abort the stream: the server cancels on disconnect, the partial reply stays in the sequence),
// delete a branch (free its sequence, or truncate one an ancestor still needs). After every generation
// the sequence's length is read back from the server, so the tree's positions are the server's.

import * as api from "./api.js";
import { glueAfter } from "./glue.js";
import * as tree from "./tree.js";

const GONE = "This branch is gone from the server (it restarted, or the sequence was idle longer than " +
  "--seq-ttl): its text is kept here but it cannot be continued. Edit an earlier message or start a new chat.";

/** A request error the page shows; `restoreText`: the message to put back in the composer. */
export class ChatError extends Error {
  constructor(message, restoreText = null) {
    super(message);
    this.restoreText = restoreText;
  }
}

/** The sampling fields of a conversation's settings, as /v1/sequences/{id}/completions takes them. */
export function samplingBody(settings) {
  const body = { max_tokens: Math.max(1, parseInt(settings.max_tokens, 10) || 256) };
  const temperature = parseFloat(settings.temperature);
  if (Number.isFinite(temperature)) body.temperature = temperature;
  const topP = parseFloat(settings.top_p);
  if (Number.isFinite(topP)) body.top_p = topP;
  if (settings.schema && settings.schema.trim()) {
    let schema;
    try {
      schema = JSON.parse(settings.schema);
    } catch (e) {
      throw new ChatError(`The JSON schema in Settings is not valid JSON (${e.message}); fix it or empty the box.`);
    }
    body.response_format = { type: "json_schema", json_schema: { name: "reply", schema, strict: true } };
  }
  return body;
}

async function onSeq(conv, seq, call) {
  try {
    return await call();
  } catch (e) {
    if (e instanceof api.ApiError && e.status === 404) {
      tree.markGone(conv, seq);
      throw new ChatError(GONE);
    }
    throw e;
  }
}

/** A sequence whose tip is the end of `node`: its own when it is the tip, else a fork at `node.end`. */
async function sequenceEndingAt(conv, node) {
  if (tree.isGone(conv, node)) throw new ChatError(GONE);
  if (tree.isTip(conv, node)) return node.seq;
  const info = await onSeq(conv, node.seq, () => api.json("POST", `/v1/sequences/${node.seq}/fork`, { at: node.end }));
  conv.seqs[info.id] = { length: info.length, gone: false };
  return info.id;
}

/** The sequence once no generation runs on it (a stopped stream is cancelled at the next engine step). */
async function settled(seq) {
  for (let i = 0; ; i++) {
    const info = await api.json("GET", `/v1/sequences/${seq}`);
    if (info.status === "idle" || i >= 50) return info;
    await new Promise((r) => setTimeout(r, 40));
  }
}

export function titleOf(text) {
  const line = text.trim().split("\n")[0];
  return line.length > 40 ? line.slice(0, 39) + "…" : line || "New chat";
}

/** Send `text` as a new user message under `parentId` (the root: a new sequence), then stream a reply. */
export async function send(conv, parentId, text, run) {
  let turn;
  try {  // nothing is generated yet: on a failure the text goes back to the composer
    turn = await appendUser(conv, parentId, text);
  } catch (e) {
    throw new ChatError(e.message, text);
  }
  if (conv.title === "New chat") conv.title = titleOf(text);
  return generate(conv, turn.user, turn.seq, turn.body, turn.usage, run);
}

/** The user's message as a node on a sequence: a new sequence at the root, else appended (or forked and
 *  appended) after `parentId`; the request body that appends it (if the create did not) and generates. */
async function appendUser(conv, parentId, text) {
  const parent = conv.nodes[parentId];
  const body = samplingBody(conv.settings);
  const message = { role: "user", content: text };
  let user;
  let seq;
  let usage;
  if (parent.role === "root") {
    const system = (conv.settings.system || "").trim();
    const messages = system ? [{ role: "system", content: system }, message] : [message];
    const info = await api.json("POST", "/v1/sequences", { messages });
    seq = info.id;
    conv.seqs[seq] = { length: info.length, gone: false };
    user = tree.addNode(conv, parentId, { role: "user", text, seq, start: 0, end: info.length,
                                          system: system || undefined });
    usage = { reused: 0, prefilled: info.length };
  } else {
    const glue = await glueAfter(conv, parent, text);
    const append = glue === null ? { messages: [message] } : { prompt: glue };
    const { count } = await api.json("POST", "/tokenize", { ...append, add_special_tokens: false });
    seq = await sequenceEndingAt(conv, parent);
    user = tree.addNode(conv, parentId, { role: "user", text, seq, start: parent.end, end: parent.end + count });
    Object.assign(body, append);
    usage = { reused: parent.end, prefilled: 0 };
  }
  return { user, seq, body, usage };
}

/** A (new) reply to the user message `userId`: regenerate is this on the reply's parent. */
export async function replyTo(conv, userId, run) {
  const user = conv.nodes[userId];
  const body = samplingBody(conv.settings);
  const seq = await sequenceEndingAt(conv, user);
  return generate(conv, user, seq, body, { reused: user.end, prefilled: 0 }, run);
}

async function generate(conv, user, seq, body, { reused, prefilled }, run) {
  const node = tree.addNode(conv, user.id, { role: "assistant", seq, start: user.end, end: user.end,
                                             status: "streaming", stats: { reused } });
  run.started(node);
  const t0 = performance.now();
  let tFirst = null;
  let usage = null;
  let finish = null;
  let failure = null;
  try {
    const res = await onSeq(conv, seq, () => api.request("POST", `/v1/sequences/${seq}/completions`,
      { ...body, stream: true, stream_options: { include_usage: true } }, { signal: run.signal }));
    for await (const event of api.events(res)) {
      if (event.error) throw new api.ApiError(500, event.error.message, event.error.code);
      const choice = event.choices?.[0];
      if (choice?.text) {
        tFirst = tFirst ?? performance.now();
        node.text += choice.text;
        run.delta(node);
      }
      if (choice?.finish_reason) finish = choice.finish_reason;
      if (event.usage) usage = event.usage;
    }
    node.status = "done";
  } catch (e) {
    node.status = run.signal.aborted ? "stopped" : "error";
    if (!run.signal.aborted) failure = e;
  }
  const tEnd = performance.now();
  if (conv.seqs[seq].gone) return discard(conv, node, user, failure);
  const info = await onSeq(conv, seq, () => settled(seq));
  conv.seqs[seq].length = info.length;
  if (info.length < user.end) return discard(conv, node, user, failure);  // the message was never appended
  node.end = info.length;
  const completion = usage?.completion_tokens ?? node.end - node.start;
  if (!completion && node.status !== "done") return discard(conv, node, null, failure);
  node.stats = {
    reused, prompt: (usage?.prompt_tokens ?? 0) + prefilled, completion, finish,
    cached: usage?.prompt_tokens_details?.cached_tokens ?? null,
    ttftMs: tFirst === null ? null : Math.round(tFirst - t0),
    tokensPerS: tFirst !== null && completion > 1 && tEnd > tFirst ? (completion - 1) / ((tEnd - tFirst) / 1000) : null,
  };
  if (failure) node.error = failure.message;
  return node;
}

/** Take back a reply that produced nothing (and its user message when that never reached the sequence). */
async function discard(conv, node, user, failure) {
  const doomed = user && user.children.length === 1 ? user : node;
  await deleteBranch(conv, doomed.id);
  const message = failure ? failure.message : "Stopped before the first token.";
  throw new ChatError(message, doomed === user ? user.text : null);
}

/** Delete the branch at `nodeId` (it and its descendants) and free its cells on the server. */
export async function deleteBranch(conv, nodeId) {
  const plan = tree.planDelete(conv, nodeId);
  const ignoreGone = (e) => { if (!(e instanceof api.ApiError && e.status === 404)) throw e; };
  for (const seq of plan.delete) await api.json("DELETE", `/v1/sequences/${seq}`).catch(ignoreGone);
  for (const { seq, length } of plan.truncate) {
    await api.json("POST", `/v1/sequences/${seq}/truncate`, { length }).catch(ignoreGone);
  }
  tree.applyDelete(conv, plan);
}

/** Delete every sequence of a conversation (the page forgets it after this). */
export async function deleteConversation(conv) {
  for (const seq of tree.liveSeqs(conv)) {
    await api.json("DELETE", `/v1/sequences/${seq}`).catch(() => {});
  }
}
