// The page's memory in localStorage: the list of conversations (ids + titles) and each conversation's
// tree (its messages, and the server sequence ids that hold them). The tokens live in the server.

const INDEX = "cellserve.chats";
const PREFIX = "cellserve.chat.";

export function loadIndex() {
  try {
    const index = JSON.parse(localStorage.getItem(INDEX));
    if (index && Array.isArray(index.list)) return index;
  } catch { /* a corrupt index starts over */ }
  return { current: null, list: [] };
}

export function saveIndex(index) {
  localStorage.setItem(INDEX, JSON.stringify(index));
}

export function loadConversation(id) {
  try {
    return JSON.parse(localStorage.getItem(PREFIX + id));
  } catch {
    return null;
  }
}

export function saveConversation(index, conv) {
  localStorage.setItem(PREFIX + conv.id, JSON.stringify(conv));
  const entry = { id: conv.id, title: conv.title, updated: conv.updated };
  const at = index.list.findIndex((c) => c.id === conv.id);
  if (at >= 0) index.list[at] = entry;
  else index.list.unshift(entry);
  saveIndex(index);
}

export function removeConversation(index, id) {
  localStorage.removeItem(PREFIX + id);
  index.list = index.list.filter((c) => c.id !== id);
  if (index.current === id) index.current = index.list[0]?.id ?? null;
  saveIndex(index);
}
