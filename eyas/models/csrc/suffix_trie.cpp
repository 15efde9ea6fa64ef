// The native suffix trie (suffix_trie.h). Every operation mirrors the Python twin in
// eyas/engine/speculative/proposers/suffix_trie.py step for step (the same node ids, the same
// order of children and of the free list, the same ties), so the two give the same answers.

#include "suffix_trie.h"

#include <algorithm>
#include <queue>
#include <stdexcept>
#include <string>

namespace eyas {

SuffixTrie::SuffixTrie(int64_t max_depth) : max_depth_(max_depth) {
  if (max_depth < 2) throw std::invalid_argument("a suffix trie needs max_depth >= 2, got " + std::to_string(max_depth));
  tokens_.push_back(-1);  // the root
  counts_.push_back(0);
  first_child_.push_back(-1);
  next_sibling_.push_back(-1);
}

int64_t SuffixTrie::count(int64_t node) const {
  if (node < 0 || node >= int64_t(counts_.size())) throw std::out_of_range("no node " + std::to_string(node));
  return counts_[node];
}

int64_t SuffixTrie::child(int64_t node, int64_t token) const {
  const auto found = edges_.find(key(node, token));
  return found == edges_.end() ? -1 : found->second;
}

std::vector<std::pair<int64_t, int64_t>> SuffixTrie::children(int64_t node) const {
  count(node);  // checks the id
  std::vector<std::pair<int64_t, int64_t>> found;
  for (int32_t c = first_child_[node]; c >= 0; c = next_sibling_[c]) found.emplace_back(tokens_[c], c);
  return found;
}

int64_t SuffixTrie::bytes() const {
  // libstdc++'s hash node: next pointer + key + value (24 bytes) + the allocator's 8; a bucket
  // pointer each; four int32 per node slot; the free list
  const int64_t slots = int64_t(counts_.capacity());
  return int64_t(edges_.size()) * 32 + int64_t(edges_.bucket_count()) * 8 + slots * 16 +
         int64_t(free_.capacity()) * 4;
}

int32_t SuffixTrie::extend(int32_t node, int64_t token) {
  const int64_t k = key(node, token);
  auto found = edges_.find(k);
  int32_t c;
  if (found != edges_.end()) {
    c = found->second;
  } else {
    if (!free_.empty()) {
      c = free_.back();
      free_.pop_back();
      tokens_[c] = int32_t(token);
      counts_[c] = 0;
      first_child_[c] = -1;
      next_sibling_[c] = first_child_[node];
    } else {
      c = int32_t(counts_.size());
      tokens_.push_back(int32_t(token));
      counts_.push_back(0);
      first_child_.push_back(-1);
      next_sibling_.push_back(first_child_[node]);
    }
    first_child_[node] = c;
    edges_.emplace(k, c);
    ++nodes_;
  }
  ++counts_[c];
  return c;
}

void SuffixTrie::insert(const std::vector<int64_t>& tokens) {
  SuffixAppender appender(std::shared_ptr<SuffixTrie>(this, [](SuffixTrie*) {}));  // not owned
  appender.extend(tokens);
}

void SuffixTrie::remove(const std::vector<int64_t>& tokens) {
  const int64_t n = int64_t(tokens.size());
  for (int64_t start = 0; start < n; ++start) {
    int32_t node = 0;
    for (int64_t i = start; i < std::min(n, start + max_depth_); ++i) {
      const auto found = edges_.find(key(node, tokens[i]));
      if (found == edges_.end()) throw std::invalid_argument("removing a sequence that was not inserted");
      const int32_t c = found->second;
      if (--counts_[c] == 0) {  // its whole subtree is at 0 too: drop it
        unlink(node, c);
        release(node, c);
        break;
      }
      node = c;
    }
  }
}

void SuffixTrie::unlink(int32_t parent, int32_t c) {
  if (first_child_[parent] == c) {
    first_child_[parent] = next_sibling_[c];
    return;
  }
  int32_t previous = first_child_[parent];
  while (next_sibling_[previous] != c) previous = next_sibling_[previous];
  next_sibling_[previous] = next_sibling_[c];
}

void SuffixTrie::release(int32_t parent, int32_t node) {
  std::vector<std::pair<int32_t, int32_t>> stack{{parent, node}};
  while (!stack.empty()) {
    const auto [up, current] = stack.back();
    stack.pop_back();
    for (int32_t c = first_child_[current]; c >= 0; c = next_sibling_[c]) stack.emplace_back(current, c);
    edges_.erase(key(up, tokens_[current]));
    first_child_[current] = -1;
    free_.push_back(current);
    --nodes_;
  }
}

std::pair<int64_t, int64_t> SuffixTrie::match(const std::vector<int64_t>& context, int64_t max_length,
                                              int64_t min_count) const {
  const int64_t n = int64_t(context.size());
  for (int64_t length = std::min({max_length, n, max_depth_ - 1}); length > 0; --length) {
    int64_t node = 0;
    for (int64_t i = n - length; i < n && node >= 0; ++i) node = child(node, context[i]);
    if (node > 0 && counts_[node] >= min_count) return {node, length};
  }
  return {0, 0};
}

std::vector<Continuation> SuffixTrie::continuations(int64_t node, int64_t denominator,
                                                    const std::vector<double>& scales, int64_t limit,
                                                    int64_t max_children, double min_probability) const {
  count(node);  // checks the id
  struct Entry {
    double value;
    int64_t tiebreak;
    int32_t child, parent, depth;  // depth: the child's
    double ratio;
  };
  // the best value first; among equal values, the first pushed (Python's heap of (-value, tiebreak))
  const auto later = [](const Entry& a, const Entry& b) {
    return a.value != b.value ? a.value < b.value : a.tiebreak > b.tiebreak;
  };
  std::priority_queue<Entry, std::vector<Entry>, decltype(later)> heap(later);
  int64_t tiebreak = 0;
  std::vector<int32_t> top;
  auto push = [&](int32_t trie_node, int32_t parent, int32_t depth, double probability, int64_t below) {
    if (below <= 0) return;
    top.clear();
    for (int32_t c = first_child_[trie_node]; c >= 0; c = next_sibling_[c]) top.push_back(c);
    if (int64_t(top.size()) > max_children) {  // heapq.nlargest: the most frequent, ties in list order
      std::stable_sort(top.begin(), top.end(), [&](int32_t a, int32_t b) { return counts_[a] > counts_[b]; });
      top.resize(max_children);
    }
    if (depth >= int32_t(scales.size())) throw std::out_of_range("continuations: no scale for depth " + std::to_string(depth));
    const double scale = scales[depth];
    for (const int32_t c : top) {
      const double ratio = double(counts_[c]) / double(below);
      const double value = probability * ratio * scale;
      if (value >= min_probability) heap.push(Entry{value, ++tiebreak, c, parent, depth + 1, ratio});
    }
  };
  std::vector<Continuation> found;
  push(int32_t(node), -1, 0, 1.0, denominator);
  while (!heap.empty() && int64_t(found.size()) < limit) {
    const Entry best = heap.top();
    heap.pop();
    found.emplace_back(tokens_[best.child], best.parent, best.depth, best.value, best.ratio);
    push(best.child, int32_t(found.size()) - 1, best.depth, best.value, counts_[best.child]);
  }
  return found;
}

void SuffixAppender::append(int64_t token) {
  SuffixTrie& trie = *trie_;
  grown_.clear();
  for (const int32_t node : active_) grown_.push_back(trie.extend(node, token));
  grown_.push_back(trie.extend(0, token));
  if (int64_t(grown_.size()) >= trie.max_depth()) {
    active_.assign(grown_.begin() + 1, grown_.end());
  } else {
    active_.swap(grown_);
  }
}

void SuffixAppender::extend(const std::vector<int64_t>& tokens) {
  for (const int64_t token : tokens) append(token);
}

std::pair<int64_t, int64_t> SuffixAppender::longest(int64_t max_length, int64_t min_count) const {
  const int64_t kept = int64_t(active_.size());
  for (int64_t length = std::min(max_length, kept); length > 0; --length) {
    const int32_t node = active_[kept - length];
    if (trie_->count(node) >= min_count) return {node, length};
  }
  return {0, 0};
}

}  // namespace eyas
