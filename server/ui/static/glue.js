// The text that continues a chat sequence after a reply with the next user message, as the model's chat
// template writes it (the way the server's Responses API continues a stored response): the conversation
// is rendered twice through the template (/tokenize, then /detokenize back to text), once up to the
// reply's generation prompt and once with a marker as the reply plus the new message; what follows the
// marker is the glue (end of turn, the new message, the next generation prompt). The reply's own tokens
// stay as the model wrote them, and a stop token it ended on is not written twice. Rendering the new
// message on its own instead would repeat what a template puts at a conversation's start (a BOS, or a
// default system prompt) in the middle of it.

import * as api from "./api.js";

const MARK = "CELLSERVE_REPLY_MARK_41c7";

async function rendered(messages) {
  const { tokens } = await api.json("POST", "/tokenize", { messages, add_generation_prompt: true });
  return (await api.json("POST", "/detokenize", { tokens })).prompt;
}

/** The text of the stop token a reply ended with (it is in the sequence), or "" if it ended otherwise. */
async function endTokenText(reply) {
  if (reply.stats?.finish !== "stop" || reply.end <= reply.start) return "";
  const info = await api.json("GET", `/v1/sequences/${reply.seq}`);
  const last = info.token_ids[reply.end - 1];
  return last === undefined ? "" : (await api.json("POST", "/detokenize", { tokens: [last] })).prompt;
}

/** The messages from the conversation's start through `node` (the system prompt it started with first). */
export function messagesTo(conv, node) {
  const path = [];
  for (let n = node; n && n.role !== "root"; n = conv.nodes[n.parent]) path.unshift(n);
  const system = path[0]?.system ? [{ role: "system", content: path[0].system }] : [];
  return [...system, ...path.map((n) => ({ role: n.role, content: n.text }))];
}

/** The glue text that appends `text` as the next user turn after the reply `reply`, or null where the
 *  template does not render the conversation as prompt + reply + glue (then the page appends the message
 *  rendered on its own). */
export async function glueAfter(conv, reply, text) {
  if (reply.role !== "assistant") return null;
  const before = messagesTo(conv, conv.nodes[reply.parent]);
  const prompt = await rendered(before);
  const full = await rendered([...before, { role: "assistant", content: MARK }, { role: "user", content: text }]);
  if (!full.startsWith(prompt + MARK)) return null;
  let glue = full.slice(prompt.length + MARK.length);
  if (glue.includes(MARK)) return null;
  const end = await endTokenText(reply);
  if (end && glue.startsWith(end)) glue = glue.slice(end.length);
  return glue || null;
}
