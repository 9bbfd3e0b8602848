// A conversation is a tree of messages; every branch lives on a server sequence (/v1/sequences).
//
// Each node records the sequence holding its tokens (`seq`) and where they lie in it: [start, end)
// (start = the sequence length before the message). A sequence holds one root-to-node path, so a node's
// tokens are also in every descendant's sequence, at the same positions: forks keep them in place.
// `conv.seqs[id].length` mirrors the server's length after each step; a node is its sequence's tip when
// that length equals `node.end`, and only then is the sequence extended in place (else it is forked at
// `node.end`). This module is pure data (no DOM, no network): app code asks it what to do, then does it.

export const DEFAULT_SETTINGS = { temperature: 0.7, top_p: 1, max_tokens: 256, system: "", schema: "" };

export function uid() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
}

export function newConversation(settings = {}) {
  const root = { id: "root", role: "root", parent: null, children: [], selected: 0, seq: null, start: 0, end: 0 };
  return { id: uid(), title: "New chat", created: Date.now(), updated: Date.now(),
           settings: { ...DEFAULT_SETTINGS, ...settings }, nodes: { root }, seqs: {} };
}

export function addNode(conv, parentId, fields) {
  const node = { id: uid(), parent: parentId, children: [], selected: 0, text: "", ...fields };
  conv.nodes[node.id] = node;
  const parent = conv.nodes[parentId];
  parent.children.push(node.id);
  parent.selected = parent.children.length - 1;
  conv.updated = Date.now();
  return node;
}

/** The nodes shown: from the root down the selected children (the root itself excluded). */
export function activePath(conv) {
  const out = [];
  let node = conv.nodes.root;
  while (node.children.length) {
    node = conv.nodes[node.children[Math.min(node.selected, node.children.length - 1)]];
    out.push(node);
  }
  return out;
}

export function leaf(conv) {
  const path = activePath(conv);
  return path.length ? path[path.length - 1] : conv.nodes.root;
}

/** Make `nodeId` part of the active path (its descendants keep their own selections). */
export function select(conv, nodeId) {
  let node = conv.nodes[nodeId];
  while (node && node.parent) {
    const parent = conv.nodes[node.parent];
    parent.selected = parent.children.indexOf(node.id);
    node = parent;
  }
}

/** "2 / 3": this node's place among its parent's children. */
export function siblingPosition(conv, node) {
  const kids = conv.nodes[node.parent].children;
  return { index: kids.indexOf(node.id), count: kids.length };
}

export function stepSibling(conv, node, delta) {
  const parent = conv.nodes[node.parent];
  const next = parent.children.indexOf(node.id) + delta;
  if (next >= 0 && next < parent.children.length) parent.selected = next;
}

export function subtree(conv, nodeId) {
  const out = [];
  const stack = [nodeId];
  while (stack.length) {
    const id = stack.pop();
    out.push(id);
    stack.push(...conv.nodes[id].children);
  }
  return out;
}

export function isTip(conv, node) {
  const seq = conv.seqs[node.seq];
  return Boolean(seq && !seq.gone && seq.length === node.end);
}

export function isGone(conv, node) {
  return node.role !== "root" && (!node.seq || !conv.seqs[node.seq] || conv.seqs[node.seq].gone);
}

/** A live sequence of one of `node`'s descendants (it holds `node`'s tokens too), skipping `avoid`. */
function descendantSeq(conv, node, avoid, skipNodes = new Set()) {
  const stack = [...node.children];
  while (stack.length) {
    const child = conv.nodes[stack.pop()];
    if (skipNodes.has(child.id)) continue;
    const seq = conv.seqs[child.seq];
    if (seq && !seq.gone && !avoid.has(child.seq)) return child.seq;
    stack.push(...child.children);
  }
  return null;
}

/** What deleting the branch at `nodeId` (it and everything below it) takes on the server: sequences only
 *  the branch uses are deleted; one an ancestor still needs (no other branch below it holds its tokens)
 *  is truncated back to where the branch starts; ancestors on a doomed sequence move to another one. */
export function planDelete(conv, nodeId) {
  const node = conv.nodes[nodeId];
  const removed = new Set(subtree(conv, nodeId));
  const doomed = new Set([...removed].map((id) => conv.nodes[id].seq).filter((s) => s && conv.seqs[s]));
  const plan = { nodeId, removed: [...removed], rehome: [], truncate: [], delete: [] };
  for (const seq of doomed) {
    let needed = false;
    for (const other of Object.values(conv.nodes)) {
      if (removed.has(other.id) || other.seq !== seq) continue;
      const alt = descendantSeq(conv, other, doomed, removed);
      if (alt) plan.rehome.push([other.id, alt]);
      else needed = true;
    }
    if (conv.seqs[seq].gone) continue;  // nothing to free on the server
    if (needed) plan.truncate.push({ seq, length: node.start });
    else plan.delete.push(seq);
  }
  return plan;
}

export function applyDelete(conv, plan) {
  const node = conv.nodes[plan.nodeId];
  const parent = conv.nodes[node.parent];
  parent.children = parent.children.filter((id) => id !== node.id);
  parent.selected = Math.max(0, Math.min(parent.selected, parent.children.length - 1));
  for (const id of plan.removed) delete conv.nodes[id];
  for (const [id, seq] of plan.rehome) conv.nodes[id].seq = seq;
  for (const { seq, length } of plan.truncate) conv.seqs[seq].length = length;
  const used = new Set(Object.values(conv.nodes).map((n) => n.seq));
  for (const seq of Object.keys(conv.seqs)) if (!used.has(seq)) delete conv.seqs[seq];
  conv.updated = Date.now();
}

/** Every sequence this conversation made (to delete them all with it). */
export function liveSeqs(conv) {
  return Object.keys(conv.seqs).filter((s) => !conv.seqs[s].gone);
}

/** Sync with the server's list of sequences: a sequence it no longer has is gone (restart, expiry,
 *  deletion elsewhere); a node on a gone sequence moves to a live descendant's if one holds its tokens.
 *  Returns how many of this conversation's sequences are gone. */
export function syncWithServer(conv, serverSeqs) {
  const live = new Map(serverSeqs.map((s) => [s.id, s]));
  for (const [id, seq] of Object.entries(conv.seqs)) {
    const info = live.get(id);
    seq.gone = !info;
    if (info && info.status === "idle") seq.length = info.length;
  }
  for (const node of Object.values(conv.nodes)) {
    if (node.role === "root" || !isGone(conv, node)) continue;
    const alt = descendantSeq(conv, node, new Set());
    if (alt) node.seq = alt;
  }
  return Object.values(conv.seqs).filter((s) => s.gone).length;
}

export function markGone(conv, seqId) {
  if (conv.seqs[seqId]) conv.seqs[seqId].gone = true;
}

export function forkCount(conv) {
  return Object.values(conv.nodes).filter((n) => n.children.length > 1).length;
}
